"""--engram-config: the peers' fields, dotted overrides, and refusals before any work."""

from __future__ import annotations

import argparse
import json

import pytest

from engram_trt.config.model import ModelConfig
from engram_trt.cli.engram_args import (
    add_engram_config_arguments,
    engram_config_from_args,
    reject_unknown_args,
    split_dotted,
)
from engram_trt.config.engram import EngramConfig
from engram_trt.errors import EngramError

BACKBONE = dict(
    architectures=["EngramLlamaForCausalLM"],
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=100,
)
ENGRAM = dict(
    engram_layer_ids=[1],
    engram_max_ngram_size=3,
    engram_n_heads=2,
    engram_head_dim=32,
    engram_vocab_size=50,
    engram_compressed_vocab_size=80,
    engram_pad_token_id=0,
)


def test_defaults_are_the_peers() -> None:
    c = EngramConfig()
    assert (c.cpu_offload, c.host_file_gather, c.dp_shared_memory, c.embedding_across_dp) == (True, False, False, False)
    assert EngramConfig.parse(None) == c and EngramConfig.parse("") == c


def test_json_text_file_and_dotted_overrides(tmp_path) -> None:
    c = EngramConfig.parse('{"cpu_offload": false, "dp_shared_memory": false}')
    assert c.cpu_offload is False
    f = tmp_path / "ec.json"
    f.write_text(json.dumps({"embedding_across_dp": True}))
    assert EngramConfig.parse(str(f)).embedding_across_dp is True
    # dotted values are JSON scalars and override the JSON object
    c = EngramConfig.parse('{"cpu_offload": true}', {"cpu_offload": "false", "table_placement": "prefetch"})
    assert c.cpu_offload is False and c.table_placement == "prefetch"


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"cpu_ofload": true}', "unknown field 'cpu_ofload'"),
        ('{"cpu_offload": "yes"}', "must be true or false"),
        ('{"cpu_offload": 1}', "must be true or false"),
        ('{"table_placement": "gpu"}', "table_placement"),
        ('[1, 2]', "expected a JSON object"),
        ('{"cpu_offload": tru}', "not valid JSON"),
        ('no-such-file.json', "neither a JSON object nor an existing file"),
    ],
)
def test_bad_input_is_one_line(text: str, needle: str) -> None:
    with pytest.raises(EngramError) as e:
        EngramConfig.parse(text)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_unknown_field_lists_the_valid_ones() -> None:
    with pytest.raises(EngramError) as e:
        EngramConfig.parse(None, {"bogus": "true"})
    for name in ("cpu_offload", "host_file_gather", "dp_shared_memory", "embedding_across_dp"):
        assert name in str(e.value)


def test_no_engram_model_refuses_engram_options() -> None:
    plain = ModelConfig.from_dict(BACKBONE)
    EngramConfig().validate_for(plain)  # defaults are fine: nothing was asked for
    with pytest.raises(EngramError, match="no Engram layers"):
        EngramConfig.parse('{"cpu_offload": false}').validate_for(plain)
    # Asking for an option is refused even when the value is its default.
    with pytest.raises(EngramError, match="cpu_offload"):
        EngramConfig.parse('{"cpu_offload": true}').validate_for(plain)
    with pytest.raises(EngramError, match="dp_shared_memory"):
        EngramConfig.parse(None, {"dp_shared_memory": "false"}).validate_for(plain)
    assert EngramConfig.parse('{"cpu_offload": true}') == EngramConfig()  # same storage choice


def test_host_file_gather_serves_engram_checkpoints() -> None:
    """The file store reads rows of any safetensors table in place (tables are stored
    row-major), so engram_* checkpoints take host_file_gather; tests/runtime/test_tables.py
    holds its rows equal to in-memory tables."""
    eng = ModelConfig.from_dict({**BACKBONE, **ENGRAM})
    cfg = EngramConfig(host_file_gather=True)
    cfg.validate_for(eng)
    assert cfg.placement == "prefetch"  # rows gathered on the host, staged for the step
    plain = ModelConfig.from_dict(BACKBONE)
    with pytest.raises(EngramError, match="no Engram layers"):
        cfg.validate_for(plain)


@pytest.mark.parametrize(
    "fields, needle",
    [
        (
            {"host_file_gather": True, "cpu_offload": False},
            "host_file_gather reads rows .* contradicts cpu_offload=false",
        ),
        ({"host_file_gather": True, "dp_shared_memory": True}, "host_file_gather and dp_shared_memory .* pick one"),
        ({"dp_shared_memory": True, "cpu_offload": False}, "dp_shared_memory shares .* contradicts cpu_offload=false"),
        (
            {"dp_shared_memory": True, "embedding_across_dp": True},
            "dp_shared_memory .* embedding_across_dp .* pick one",
        ),
        (
            {"host_file_gather": True, "table_placement": "in_engine"},
            "cannot run in the engine; use table_placement 'prefetch'",
        ),
    ],
)
def test_contradictions_refused(fields: dict, needle: str) -> None:
    with pytest.raises(EngramError, match=needle):
        EngramConfig.from_dict(fields).validate()


def test_argparse_flags() -> None:
    p = argparse.ArgumentParser()
    add_engram_config_arguments(p)
    args = p.parse_args(
        [
            "--engram-config",
            '{"cpu_offload": true}',
            "--engram-config.cpu_offload",
            "false",
            "--engram-config.embedding_across_dp=true",
        ]
    )
    c = engram_config_from_args(args)
    assert c.cpu_offload is False and c.embedding_across_dp is True
    # a misspelled dotted flag: parse_known_args leaves it, reject_unknown_args names it
    _, extra = p.parse_known_args(["--engram-config.cpu_ofload", "false"])
    with pytest.raises(EngramError, match="unknown field 'cpu_ofload'.*cpu_offload"):
        reject_unknown_args(extra)
    rest, found = split_dotted(["x", "--engram-config.cpu_offload", "false", "--engram-config.dp_shared_memory=true"])
    assert rest == ["x"] and found == {"cpu_offload": "false", "dp_shared_memory": "true"}
    with pytest.raises(EngramError, match="unknown field 'nope'"):
        split_dotted(["--engram-config.nope", "1"])
