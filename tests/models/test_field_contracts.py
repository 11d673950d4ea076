"""Every architecture in the registry, table-driven over its pinned config fields: a
value other than the implemented one is refused in one line naming the field, the value
and what is supported, by the architecture's reader and by ``engram-trt run`` (exit 2,
nothing written); the implemented value (and the field absent) reads. The supported
values' numerics are each family's parity tests' (test_llama_parity, test_qwen4_exp_parity,
test_deepseek_v4_parity)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from helpers.checkpoints import TINY_CONFIG
from helpers.files import DATA
from engram_trt.errors import ConfigError
from engram_trt.models.registry import _registered, resolve

DATA = DATA
# A config each architecture serves: the tiny checkpoints transformers saved, and the
# engram-llama tiny config of helpers.checkpoints.
CONFIGS: dict[str, Any] = {
    "engram-llama": lambda: dict(TINY_CONFIG),
    "qwen4-exp": lambda: json.loads((DATA / "qwen4_exp_tiny" / "config.json").read_text()),
    "deepseek-v4": lambda: json.loads((DATA / "deepseek_v4_tiny" / "config.json").read_text()),
}
FOLDERS = {"qwen4-exp": DATA / "qwen4_exp_tiny", "deepseek-v4": DATA / "deepseek_v4_tiny"}


def _unsupported(default: Any, values: tuple[Any, ...]) -> Any:
    """A value the field may take in some published config but the architecture does not implement."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, str):
        return "gelu_pytorch_tanh"
    if isinstance(default, int):
        return default + 1
    return {"quant_method": "gptq", "bits": 4}


CASES = [(arch.name, field, rule) for arch in _registered() for field, rule in sorted(arch.contract.pinned.items())]


def test_every_registered_architecture_has_a_config_here() -> None:
    assert sorted(CONFIGS) == sorted(arch.name for arch in _registered())


@pytest.mark.parametrize("name, field, rule", CASES, ids=[f"{n}-{f}" for n, f, _ in CASES])
def test_pinned_field_refused_unless_implemented(name: str, field: str, rule: Any) -> None:
    d = CONFIGS[name]()
    arch = resolve(d)
    assert arch.name == name
    arch.read_config(d)  # the config as saved reads
    arch.read_config({**d, field: rule.values[0]})
    arch.read_config({k: v for k, v in d.items() if k != field})
    bad = _unsupported(rule.default, rule.values)
    assert bad not in rule.values
    with pytest.raises(ConfigError) as exc:
        arch.read_config({**d, field: bad})
    msg = str(exc.value)
    assert "\n" not in msg and f"'{field}'" in msg and "supported" in msg and json.dumps(rule.values[0]) in msg


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_run_refuses_an_unimplemented_value_in_one_line(tmp_path: Path, capsys: Any, name: str) -> None:
    from engram_trt.cli.main import main

    folder = tmp_path / "ck"
    shutil.copytree(FOLDERS[name], folder)
    d = json.loads((folder / "config.json").read_text())
    d["hidden_act"] = "gelu_pytorch_tanh"
    (folder / "config.json").write_text(json.dumps(d))
    before = sorted(p.name for p in folder.iterdir())
    assert main(["run", str(folder), "--prompt", "w5 w6", "--max-new-tokens", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'hidden_act'" in err and "gelu_pytorch_tanh" in err
    assert sorted(p.name for p in folder.iterdir()) == before
