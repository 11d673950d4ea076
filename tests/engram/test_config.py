"""Config parsing: both spellings, and a one-line error naming each bad field."""

from __future__ import annotations

import json

import pytest

from engram_trt.config.model import ModelConfig, load_config, load_engram_spec, parse_engram_spec
from engram_trt.errors import ConfigError
from engram_trt.engram.layout import EngramLayout

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "hc_mult": 2,
}
ENGRAM = {
    "engram_layer_ids": [1, 2],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 500,
    "engram_compressed_vocab_size": 700,
    "engram_pad_token_id": 1,
}


def test_retired_ple_twins_are_refused_with_the_real_fields():
    """The ple_* twins of the engram_* fields were never a published format: a config
    carrying them gets one line naming Qwen4Exp's real PLE fields."""
    with pytest.raises(
        ConfigError,
        match=r"'ple_max_ngram_size' is not a Qwen4Exp field: PLE is declared by 'ple_layer_ids'"
        r".*ngram_size.*heads_per_ngram",
    ):
        ModelConfig.from_dict(BASE | {k.replace("engram_", "ple_"): v for k, v in ENGRAM.items()})
    # Qwen4Exp's own fields in an engram-llama config: PLE is not served silently dropped.
    with pytest.raises(ConfigError, match=r"'ple_layer_ids' declares Qwen4Exp's PLE.*Qwen4ExpForCausalLM"):
        ModelConfig.from_dict(BASE | {"ple_layer_ids": [1], "ngram_size": 3})
    a = ModelConfig.from_dict(BASE | ENGRAM)
    assert a.engram.prefix == "engram" and a.head_dim == 16 and a.num_key_value_heads == 2 and a.engram.n_hash_cols == 4


def test_model_without_engram_fields():
    cfg = ModelConfig.from_dict(BASE)
    assert cfg.engram is None
    with pytest.raises(ConfigError, match="no Engram layers"):
        cfg.require_engram("building Engram tables")


def test_to_dict_round_trip():
    cfg = ModelConfig.from_dict(BASE | ENGRAM)
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again == cfg


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"engram_max_ngram_size": 1}, "engram_max_ngram_size"),
        ({"engram_n_heads": "4"}, "engram_n_heads"),
        ({"engram_layer_ids": [1, 1]}, "engram_layer_ids"),
        ({"engram_layer_ids": [1, 9]}, "engram_layer_ids"),
        ({"engram_compressed_vocab_size": None}, "engram_compressed_vocab_size"),
        ({"engram_head_dim": 48}, "engram_head_dim"),
        ({"engram_vocab_size": [500, 600, 700]}, "engram_vocab_size"),
        ({"engram_num_embeddings": [10, 10, 10]}, "engram_num_embeddings"),
        ({"engram_table_dtype": "int4"}, "engram_table_dtype"),
        ({"engram_pad_token_id": 5000}, "engram_pad_token_id"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
        ({"eos_token_id": "x"}, "eos_token_id"),
        ({"bos_token_id": -1}, "bos_token_id"),
        ({"rope_theta": float("inf")}, "rope_theta"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"torch_dtype": 16}, "torch_dtype"),
    ],
)
def test_bad_fields_are_named(patch, field):
    with pytest.raises(ConfigError) as exc:
        ModelConfig.from_dict(BASE | ENGRAM | patch)
    msg = str(exc.value)
    assert field in msg and "\n" not in msg


def test_engram_field_without_layer_ids_is_refused():
    with pytest.raises(ConfigError, match="engram_layer_ids"):
        parse_engram_spec({"engram_n_heads": 4})


def test_num_embeddings_must_cover_layout():
    spec = parse_engram_spec(ENGRAM | {"engram_num_embeddings": 100})
    with pytest.raises(ConfigError, match="does not cover the layout"):
        EngramLayout.from_spec(spec, 0)
    rows = EngramLayout.from_spec(parse_engram_spec(ENGRAM), 0).table_rows
    ok = parse_engram_spec(ENGRAM | {"engram_num_embeddings": [int(r) for r in rows]})
    EngramLayout.from_spec(ok, 0)


def test_load_from_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE | ENGRAM))
    assert load_config(tmp_path).engram.layer_ids == (1, 2)
    assert load_engram_spec(tmp_path / "config.json").n_heads == 2
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="no config file"):
        load_config(tmp_path / "missing")
    (tmp_path / "plain.json").write_text(json.dumps(BASE))
    with pytest.raises(ConfigError, match="no Engram fields"):
        load_engram_spec(tmp_path / "plain.json")


def test_eos_list_keeps_every_id():
    cfg = ModelConfig.from_dict(BASE | ENGRAM | {"eos_token_id": [7, 9]})
    assert cfg.eos_token_ids == (7, 9)
    assert ModelConfig.from_dict(cfg.to_dict()).eos_token_ids == (7, 9)
    assert ModelConfig.from_dict(BASE | {"eos_token_id": 3}).eos_token_ids == (3,)
