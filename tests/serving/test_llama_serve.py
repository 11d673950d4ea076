"""A plain HF ``LlamaForCausalLM`` folder (no Engram layers) through ``engram-trt build``
(TensorRT-RTX builds the engine on a CPU) and then served from the engine folder: by
``engram_trt.LLM`` and by a real ``tritonserver`` started by ``engram-trt serve`` (CPU,
torch backend). Greedy tokens equal transformers' ``generate`` on the same folder, and
a model without Engram layers never opens a table store, a prefetcher or a lookup.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

from helpers.checkpoints import words  # noqa: E402
from helpers.serving import assert_served_tokens, require_tritonserver, start_serve, stop_serve  # noqa: E402
from helpers.llama import NEW_TOKENS, PROMPTS, SUPPORTED, hf_greedy, save_llama  # noqa: E402

from engram_trt.cli.main import main  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[list[int]], dict[str, Any]]:
    """(checkpoint, engine folder, transformers' greedy tokens per prompt, build report)."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("llamaserve")
    model = save_llama(root / "ck", seed=13, **SUPPORTED["llama3"])
    want = [hf_greedy(model, p) for p in PROMPTS]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["build", str(root / "ck"), "--output", str(root / "engine"), "--json"])
    assert code == 0
    return root / "ck", root / "engine", want, json.loads(out.getvalue())


def test_build_writes_an_engine_folder_without_tables(built: tuple[Path, Path, list[list[int]], dict]) -> None:
    _ck, engine, _want, report = built
    assert report["tables_bytes"] == 0
    manifest = json.loads((engine / "manifest.json").read_text())
    assert not manifest.get("tables")  # nothing described: there are no Engram layers
    if report["engine_skipped"] is None:  # TensorRT(-RTX) importable: a real engine was built
        assert (engine / "model.engine").stat().st_size == report["engine_bytes"] > 0


def test_engine_folder_gives_transformers_tokens_and_no_tables(built: tuple[Path, Path, list[list[int]], dict]) -> None:
    from engram_trt import LLM, SamplingParams

    _ck, engine, want, _report = built
    threads_before = {t.ident for t in threading.enumerate()}
    with LLM(str(engine), backend="torch", device="cpu", dtype="fp32", progress=False) as llm:
        assert llm.source.kind == "engine"
        assert llm.source.table_refs in (None, [], ()) and llm.source.layout is None
        assert llm.runner.tables is None and llm.runner.table_kind == "none"
        assert llm.runner.prefetcher is None and llm.runner.engram_lookup is None
        assert llm.storage == {"kind": "none"}
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
        assert "engram" not in llm.stats()  # no lookup counters: no lookup ran
        assert llm.runner.prefetcher is None and llm.runner.tables is None
        started = [t.name for t in threading.enumerate() if t.ident not in threads_before]
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert not [n for n in started if "prefetch" in n.lower() or "gather" in n.lower()], started


def test_engram_options_on_the_engine_folder_are_refused(
    built: tuple[Path, Path, list[list[int]], dict], capsys: Any
) -> None:
    _ck, engine, _want, _report = built
    code = main(
        [
            "run",
            str(engine),
            "--prompt",
            "w5 w6",
            "--max-new-tokens",
            "2",
            "--device",
            "cpu",
            "--engram-config",
            '{"cpu_offload": false}',
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "no Engram layers" in err[0] and "cpu_offload" in err[0]


@pytest.fixture(scope="module")
def served(built: tuple[Path, Path, list[list[int]], dict]):
    require_tritonserver()
    _ck, engine, want, _report = built
    log = engine.parent / "tritonserver.log"
    proc, info = start_serve(
        engine, log, "--device", "cpu", "--backend", "torch", "--max-batch-size", "4", "--max-num-tokens", "64"
    )
    yield info, want
    stop_serve(proc)


def test_served_engine_folder_gives_transformers_tokens(served: tuple[dict, list[list[int]]]) -> None:
    from engram_trt.triton import client as hc

    info, want = served
    assert_served_tokens(info["http"], PROMPTS, want, NEW_TOKENS)
    events = hc.generate_stream(
        info["http"], {"text_input": words(PROMPTS[1]), "max_tokens": NEW_TOKENS, "ignore_eos": True}
    )
    _text, ids, _finish, error = hc.collect(events)
    assert error is None and ids == want[1]
