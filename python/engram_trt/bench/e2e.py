"""``engram-trt bench e2e``: a model's decode rate end to end, as a user gets it, against
transformers and against the bytes a decode step must read (issue 41, item 4).

For each ``--shapes`` entry (or the one ``--path`` folder) in one call:

1. the checkpoint: ``deepseek-v4`` (the ~1.63B DeepSeek-V4 of ``bench dsv4-step`` without its
   Engram layers), ``qwen4`` (a Qwen4Exp that reads ~1.15B weights a decode step), both
   made by transformers 5.25 (the test extra) with its own random weights (the hash
   routing's ``tid2eid`` drawn, which transformers leaves zero) and ``save_pretrained``,
   with a word-level tokenizer; ``demo`` (engram-llama's random demo checkpoint, which
   transformers does not implement); ``deepseek-v4-tiny`` / ``qwen4-tiny`` for a CPU smoke run
   (``dsv4`` / ``dsv4-tiny``, the former spelling, are accepted and named as given);
2. the floor: the bytes a decode step of one sequence reads (every weight the model
   reads but the embedding table, of which one row, and the routed experts one token
   does not reach: top-k of E; the tied head reads the whole table) over the HBM copy
   rate measured in this run (``bench.common.measure_limits``);
3. transformers' ``generate`` on the same folder, same dtype, same prompt, batch 1,
   eager (no compile), greedy: its steady rate from the times its tokens came out (one
   over the median step after two warm-up steps, the runtime's ``steady_decode``);
4. ``engram-trt run`` on the folder (a fresh process, its ``--json``): the steady decode
   rate, batch 1, and the greedy tokens (compared with transformers' for the record);
5. ``engram-trt bench serve`` on the folder at ``--concurrency`` (1 / 8 / 32 / 64 streams,
   a fresh process): tokens/s per level and the ratio to one stream;
6. ``--breakdown``: where one graphed decode step's GPU time goes, by module kind
   (:mod:`engram_trt.bench.breakdown`: CUDA events recorded inside the step's CUDA graph);
   ``--breakdown-detail`` adds the spans inside the kinds (DeepSeek-V4's fused launches);
   ``--breakdown-kernels``: the same step's kernels by their own GPU durations (the CUDA
   profiler's records, no events in the step; ``breakdown.decode_kernel_profile``).

Printed as a table and written with ``--json``: tokens/s, ms per step, the floor, ours /
floor (how many floors a step takes) and ours / transformers; ``--plot`` draws bench serve's
tokens/s against streams, one line per model, as an SVG.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engram_trt.bench.options import opt
from engram_trt.errors import EngramError

# The DeepSeek-V4 shapes under the registry's spelling; the former one still accepted.
SHAPE_ALIASES = {"dsv4": "deepseek-v4", "dsv4-tiny": "deepseek-v4-tiny"}
SHAPES = ("deepseek-v4", "qwen4", "demo", "deepseek-v4-tiny", "qwen4-tiny", *SHAPE_ALIASES)
TRANSFORMERS_SHAPES = ("deepseek-v4", "qwen4", "deepseek-v4-tiny", "qwen4-tiny", *SHAPE_ALIASES)
QWEN4_TINY = Path(__file__).resolve().parents[3] / "tests" / "data" / "qwen4_exp_tiny" / "config.json"
_DROP = ("architectures", "model_type", "transformers_version", "dtype")
TEXT_PROMPT = "Engram layers look up n-grams in"  # the prompt of a folder whose tokenizer is not the made word one


@dataclass(kw_only=True)
class E2eOptions:
    """``engram-trt bench e2e``'s flags."""

    shapes: list[str] = opt(
        ["deepseek-v4", "qwen4", "demo"],
        choices=SHAPES,
        help="models to make and run, comma-separated: deepseek-v4 (~1.63B DeepSeek-V4), qwen4 "
        "(Qwen4Exp reading ~1.15B weights a step), demo (engram-llama's demo), deepseek-v4-tiny "
        "/ qwen4-tiny (CPU smoke runs) (default: deepseek-v4,qwen4,demo)",
    )
    path: str | None = opt(
        None,
        metavar="FOLDER",
        help="run this checkpoint folder instead of making the --shapes ones (transformers runs it "
        "when it implements its architecture)",
    )
    work_dir: str | None = opt(
        None, metavar="DIR", help="where the made checkpoints go, kept (default: a temporary folder, removed after)"
    )
    device: str = opt("cuda", choices=("cuda", "cpu"), help="where everything runs (default: %(default)s)")
    dtype: str = opt(
        "bf16", choices=("bf16", "fp32"), help="the checkpoints' and every run's dtype (default: %(default)s)"
    )
    backend: str = opt(
        "auto",
        choices=("auto", "tensorrt", "torch"),
        help="engram-trt's runtime backend for run and bench serve (default: %(default)s)",
    )
    prompt_tokens: int = opt(32, argtype=("int_arg", 1, 4096), help="prompt length (default: %(default)s)")
    max_tokens: int = opt(
        128, argtype=("int_arg", 4, 4096), help="new tokens per request in every run (default: %(default)s)"
    )
    concurrency: list[int] = opt([1, 8, 32, 64], help="bench serve's stream counts (default: 1,8,32,64)")
    serve_repeat: int = opt(
        1, argtype=("int_arg", 1, 20), help="bench serve's runs per level, the fastest counts (default: %(default)s)"
    )
    no_transformers: bool = opt(False, help="skip transformers' generate")
    breakdown: bool = opt(False, help="also time one graphed decode step by module kind (CUDA events in the graph)")
    breakdown_detail: bool = opt(
        False,
        help="with --breakdown (DeepSeek-V4): also the spans inside the kinds (the "
        "fused glue's launches by kernel, the attention core), reported apart",
    )
    breakdown_kernels: bool = opt(
        False,
        help="also profile one graphed decode step's kernels (DeepSeek-V4, Qwen4Exp): each kernel's own GPU "
        "time a step as the CUDA profiler records it, no events in the step; the busy time and the gaps",
    )
    breakdown_streams: int = opt(
        1,
        argtype=("int_arg", 1, 256),
        help="the sequences of the step --breakdown-kernels profiles (a batch of decode streams, as bench serve's "
        "levels; default: %(default)s)",
    )
    breakdown_reps: int = opt(
        5,
        argtype=("int_arg", 1, 1000),
        help="replays the breakdown's medians take, and the steps --breakdown-kernels profiles (default: %(default)s)",
    )
    json: str | None = opt(None, metavar="FILE", help="write the figures as JSON to FILE")
    plot: str | None = opt(
        None, metavar="FILE", help="write bench serve's tokens/s against streams, one line per model, as an SVG to FILE"
    )


# ---------------------------------------------------------------------------- checkpoints
def transformers_config(shape: str) -> tuple[str, str, dict[str, Any]]:
    """``(model class, config class, config kwargs)`` of a transformers-made shape."""
    if SHAPE_ALIASES.get(shape, shape) in ("deepseek-v4", "deepseek-v4-tiny"):
        from engram_trt.bench.dsv4model import bench_config

        d = bench_config(
            "1b" if SHAPE_ALIASES.get(shape, shape) == "deepseek-v4" else "tiny", table_gib=0.01, max_len=4096
        )
        kw = {k: v for k, v in d.items() if not k.startswith("engram_") and k not in _DROP}
        return "DeepseekV4ForCausalLM", "DeepseekV4Config", kw
    if shape in ("qwen4", "qwen4-tiny"):
        if shape == "qwen4":
            from engram_trt.bench.qwen4step import Qwen4StepOptions, bench_config

            # bench qwen4-step's ~1.3B shape with DeepSeek's vocabulary (its head makes the 1.15B a step reads)
            # and small PLE tables (a 20,000 n-gram base: ~0.08B rows' parameters, written in seconds)
            d = dict(bench_config(Qwen4StepOptions(ple_base=20_000)), vocab_size=129280)
        else:
            d = json.loads(QWEN4_TINY.read_text())
        return "Qwen4ExpForCausalLM", "Qwen4ExpTextConfig", {k: v for k, v in d.items() if k not in _DROP}
    raise EngramError(
        f"--shapes {shape!r}: transformers makes only "
        f"{', '.join(s for s in TRANSFORMERS_SHAPES if s not in SHAPE_ALIASES)}"
    )


def _need_transformers(what: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise EngramError(
            f"{what} needs transformers (the test extra: pip install 'engram-trt[test]'), which is not "
            "installed; install it, or pass --path FOLDER (and --no-transformers)"
        ) from None
    return transformers


def word_tokenizer(path: Path, words: int) -> Path:
    """A word-level tokenizer.json: ids 0..words-1 are the words ``w0``.. (one token each)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def make_checkpoint(
    shape: str, folder: Path, *, device: Any = "cpu", dtype: str = "bf16", seed: int = 0, keep_model: bool = False
) -> Any:
    """Save a transformers model of ``shape`` with random weights (its own initialization,
    the hash routing tables drawn: a token's ``top_k`` distinct experts) into ``folder``
    in ``dtype``, with a word tokenizer. Returns the model (on ``device``) when
    ``keep_model``, else None (freed)."""
    import torch

    transformers = _need_transformers(f"bench e2e --shapes {shape}")
    model_cls, cfg_cls, kw = transformers_config(shape)
    cfg = getattr(transformers, cfg_cls)(**kw)
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, model_cls)(cfg)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                vocab, k = buf.shape
                experts = int(kw["n_routed_experts"])
                first = torch.randint(0, experts, (vocab, 1), generator=gen, device=buf.device)
                buf.copy_((first + torch.arange(k, device=buf.device)) % experts)
    model = model.to({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    word_tokenizer(folder / "tokenizer.json", int(kw["vocab_size"]))
    if keep_model:
        return model
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return None


def demo_checkpoint() -> Path:
    from engram_trt.models.engram_llama.demo import ensure_demo_checkpoint

    return Path(ensure_demo_checkpoint(seed=0))


# ---------------------------------------------------------------------------- the floor
def decode_bytes(source: Any, itemsize: int, batch: int = 1) -> dict[str, Any]:
    """The weight bytes a decode step of ``batch`` sequences reads (module docstring),
    from the architecture's weight shapes: ``weight_bytes``, ``params_read``, ``params``."""
    import re

    cfg = source.config
    shapes = source.architecture.weight_shapes(cfg)
    vocab = int(cfg.vocab_size)
    experts = int(getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_experts", None) or 0)
    k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
    touched = min(1.0, 1 - (1 - k / experts) ** batch) if experts and k else 1.0
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    expert_re = re.compile(r"\.experts\.\d+\.")
    total = read = 0.0
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= int(d)
        total += n
        if name.endswith("tid2eid"):  # an integer routing table: one row per token
            continue
        if len(shape) == 2 and int(shape[0]) == vocab and "embed" in name and not tied:
            read += batch * int(shape[1])  # the embedding: the step's rows
        elif expert_re.search(name):
            read += n * touched
        else:
            read += n
    return {
        "weight_bytes": round(read) * itemsize,
        "params_read": round(read),
        "params": int(total),
        "experts_touched_share": touched,
    }


# ---------------------------------------------------------------------------- the runs
def prompt_ids(n: int, vocab: int) -> list[int]:
    """A fixed prompt of ``n`` ids, none below 3 (no special token of the made tokenizers)."""
    return [(17 * i + 5) % max(vocab - 3, 1) + 3 for i in range(n)]


class _Clock:
    """A transformers streamer that records when each new token came out."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt = True

    def put(self, value: Any) -> None:
        if self._prompt:  # generate hands the prompt first
            self._prompt = False
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def transformers_generate(folder: Path, prompt: list[int], max_tokens: int, device: Any, dtype: str) -> dict[str, Any]:
    """transformers' greedy ``generate`` of ``prompt`` (batch 1, eager): its tokens, the
    steady rate and the whole call's rate (after one warm-up call of 4 tokens)."""
    import torch

    from engram_trt.runtime.scheduler import steady_decode

    transformers = _need_transformers("transformers' generate")
    dev = torch.device(device)
    t0 = time.perf_counter()
    # use_kernels=False: transformers' own PyTorch modules (by default it asks the `kernels` package for hub
    # kernels, and refuses to load without it)
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype], use_kernels=False
        )
        .to(dev)
        .eval()
    )
    load_s = time.perf_counter() - t0
    ids = torch.tensor([prompt], device=dev)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=True)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, **kw)  # warm-up: kernels, allocator
        clock = _Clock()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_tokens, streamer=clock, **kw)
        total = time.perf_counter() - t0
    tokens = out[0, len(prompt) :].tolist()
    del model, out
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    res = {
        "token_ids": tokens,
        "load_s": round(load_s, 3),
        "generate_s": round(total, 4),
        "tokens_per_s": round(len(tokens) / total, 2),
        **steady_decode(clock.times),
    }
    return res


def _cli_json(args: list[str], what: str) -> tuple[dict[str, Any], float]:
    from engram_trt.bench.steady import _cli

    out, dt = _cli(args, what)
    return json.loads(out), dt


def engram_run(folder: Path, prompt: list[int], opts: E2eOptions, words: bool) -> dict[str, Any]:
    """``engram-trt run FOLDER --json`` in a fresh process (module docstring)."""
    from engram_trt.bench.steady import _generation_figures

    text = " ".join(f"w{i}" for i in prompt) if words else TEXT_PROMPT
    args = [
        "run",
        str(folder),
        "--max-new-tokens",
        str(opts.max_tokens),
        "--ignore-eos",
        "--json",
        "--device",
        opts.device,
        "--dtype",
        opts.dtype,
        "--backend",
        opts.backend,
        "--prompt",
        text,
    ]
    res, dt = _cli_json(args, "run")
    out = _generation_figures(res, dt)
    out.update(
        token_ids=res.get("token_ids"),
        prompt_tokens=res.get("prompt_tokens"),
        command="engram-trt " + " ".join(a if " " not in a else repr(a) for a in args),
    )
    return out


def engram_serve(folder: Path, opts: E2eOptions) -> dict[str, Any]:
    """``engram-trt bench serve FOLDER`` at ``--concurrency`` in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="engram-e2e-") as tmp:
        figures = Path(tmp) / "serve.json"
        args = [
            "bench",
            "serve",
            str(folder),
            "--concurrency",
            ",".join(map(str, opts.concurrency)),
            "--max-tokens",
            str(opts.max_tokens),
            "--prompt-tokens",
            str(opts.prompt_tokens),
            "--repeat",
            str(opts.serve_repeat),
            "--device",
            opts.device,
            "--backend",
            opts.backend,
            "--json",
            str(figures),
        ]
        from engram_trt.bench.steady import _cli

        _out, dt = _cli(args, "bench serve")
        serve = json.loads(figures.read_text())
    levels = {
        int(n): {
            "tokens_per_s": r.get("tokens_per_s"),
            "ratio_to_one": r.get("ratio_to_one"),
            "steady_decode_tokens_per_s": r.get("steady_decode_tokens_per_s"),
            "mean_seqs_per_step": r.get("mean_seqs_per_step"),
            "chained_steps": r.get("chained_steps"),
        }
        for n, r in (serve.get("levels") or {}).items()
    }
    return {
        "backend": serve.get("backend"),
        "levels": levels,
        "command_s": round(dt, 2),
        "command": "engram-trt " + " ".join(args[:-2]),
    }


def ratios(floor_ms: float | None, ours_tps: float | None, hf_tps: float | None) -> dict[str, Any]:
    """``over_floor``: our decode step over the floor (how many floors a step takes);
    ``over_transformers``: our tokens/s over transformers'."""
    step_ms = 1e3 / ours_tps if ours_tps else None
    return {
        "ms_per_step": round(step_ms, 4) if step_ms else None,
        "over_floor": round(step_ms / floor_ms, 2) if step_ms and floor_ms else None,
        "over_transformers": round(ours_tps / hf_tps, 2) if ours_tps and hf_tps else None,
    }


def _family(source: Any) -> str:
    name = type(source.architecture).__name__.lower()
    return "deepseek-v4" if "deepseek" in name else ("qwen4-exp" if "qwen4" in name else "engram-llama")


def bench_folder(folder: Path, shape: str, opts: E2eOptions, limits: dict[str, float]) -> dict[str, Any]:
    """Every figure of one folder (module docstring, steps 2-6)."""
    import torch

    from engram_trt.runtime.engine_folder import open_model_source

    source = open_model_source(folder, progress=False)
    family = _family(source)
    itemsize = 2 if opts.dtype == "bf16" else 4
    floor = decode_bytes(source, itemsize)
    if limits:
        floor["hbm_GBps"] = round(limits["hbm_GBps"], 1)
        floor["floor_ms"] = round(floor["weight_bytes"] / (limits["hbm_GBps"] * 1e9) * 1e3, 4)
    vocab = int(source.config.vocab_size)
    words = _is_word_tokenizer(folder / "tokenizer.json")  # the made checkpoints' (a prompt of ids as words)
    prompt = prompt_ids(opts.prompt_tokens, vocab) if words else _encode(folder)
    res: dict[str, Any] = {
        "shape": shape,
        "folder": str(folder),
        "family": family,
        "floor": floor,
        "prompt_tokens": opts.prompt_tokens,
        "max_tokens": opts.max_tokens,
    }
    hf = None
    engram = source.config.engram is not None
    skip = (
        "--no-transformers"
        if opts.no_transformers
        else f"transformers has no {'engram-llama' if family == 'engram-llama' else family + ' with Engram layers'}"
        if family == "engram-llama" or engram
        else None
    )
    if skip is None:
        hf = res["transformers"] = transformers_generate(folder, prompt, opts.max_tokens, opts.device, opts.dtype)
    else:
        res["transformers"] = {"skipped": skip}
    run = res["run"] = engram_run(folder, prompt, opts, words)
    if hf is not None and run.get("token_ids") is not None:
        a, b = run["token_ids"], hf["token_ids"]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        res["tokens_equal_until"] = min(len(a), len(b)) if first is None else first
    res["serve"] = engram_serve(folder, opts)
    hf_tps = hf.get("steady_decode_tokens_per_s") if hf else None
    res["ratios"] = {"run": ratios(floor.get("floor_ms"), run.get("steady_decode_tokens_per_s"), hf_tps)}
    lv = res["serve"]["levels"]
    if 1 in lv and max(lv) > 1:
        res["serve_scaling"] = {
            n: round(r["tokens_per_s"] / lv[1]["tokens_per_s"], 2)
            for n, r in lv.items()
            if r.get("tokens_per_s") and lv[1].get("tokens_per_s")
        }
    if opts.breakdown:
        from engram_trt.bench.breakdown import decode_breakdown

        res["breakdown"] = decode_breakdown(
            folder,
            device=opts.device,
            dtype=opts.dtype,
            prompt_tokens=opts.prompt_tokens,
            reps=opts.breakdown_reps,
            detail=opts.breakdown_detail,
        )
    if opts.breakdown_kernels:
        from engram_trt.bench.breakdown import decode_kernel_profile

        res["kernel_profile"] = decode_kernel_profile(
            folder,
            device=opts.device,
            dtype=opts.dtype,
            prompt_tokens=opts.prompt_tokens,
            reps=opts.breakdown_reps,
            seqs=opts.breakdown_streams,
        )
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def _encode(folder: Path) -> list[int]:
    """:data:`TEXT_PROMPT` in the folder's tokenizer (the ids transformers is given)."""
    from engram_trt.engram.tokenizer import load_tokenizer

    return list(load_tokenizer(folder).encode(TEXT_PROMPT).ids)


def _is_word_tokenizer(path: Path) -> bool:
    try:
        model = json.loads(path.read_text()).get("model") or {}
    except (OSError, ValueError):
        return False
    return model.get("type") == "WordLevel" and "w0" in (model.get("vocab") or {})


# ---------------------------------------------------------------------------- report
def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.3f}M"


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def report(res: dict[str, Any]) -> list[str]:
    """The printed table of one folder."""
    fl = res["floor"]
    lines = [
        f"{res['shape']} ({res['family']}, {_count(fl['params'])} parameters, {_count(fl['params_read'])} read a "
        f"decode step): {res['folder']}"
    ]
    if "floor_ms" in fl:
        lines.append(
            f"  floor: {fl['weight_bytes'] / 1e9:.3f} GB / {fl['hbm_GBps']:.0f} GB/s (HBM copy, measured now) "
            f"= {fl['floor_ms']:.3f} ms a decode step"
        )
    hf, run = res["transformers"], res["run"]
    r = res["ratios"]["run"]
    lines.append(f"  {'':24} {'tokens/s':>10} {'ms/step':>9} {'x floor':>8} {'x transformers':>15}")
    if "skipped" not in hf:
        hms = 1e3 / hf["steady_decode_tokens_per_s"] if hf.get("steady_decode_tokens_per_s") else None
        over = hms / fl["floor_ms"] if hms and fl.get("floor_ms") else None
        lines.append(
            f"  {'transformers generate':24} {_fmt(hf.get('steady_decode_tokens_per_s')):>10} "
            f"{_fmt(hms, '.3f'):>9} {_fmt(over):>8} {'1.00':>15}"
        )
    else:
        lines.append(f"  transformers generate: skipped ({hf['skipped']})")
    lines.append(
        f"  {'engram-trt run':24} {_fmt(run.get('steady_decode_tokens_per_s')):>10} "
        f"{_fmt(r['ms_per_step'], '.3f'):>9} {_fmt(r['over_floor']):>8} {_fmt(r['over_transformers'], '.2f'):>15}"
    )
    if "tokens_equal_until" in res:
        lines.append(
            f"  greedy tokens equal to transformers' for the first {res['tokens_equal_until']} of "
            f"{len(run.get('token_ids') or [])}"
        )
    lines.append(f"  bench serve ({res['serve']['backend']}):")
    for n, lvl in sorted(res["serve"]["levels"].items()):
        queued = lvl.get("chained_steps")  # the overlapped decode (off with ENGRAM_TRT_OVERLAP=0): said when it ran
        lines.append(
            f"    {n:>3} streams {_fmt(lvl.get('tokens_per_s')):>10} tokens/s  x{_fmt(lvl.get('ratio_to_one'), '.2f')} "
            f"one stream" + (f"  ({queued} decode steps queued ahead)" if queued else "")
        )
    if "breakdown" in res:
        from engram_trt.bench.breakdown import format_breakdown

        lines += ["  " + line for line in format_breakdown(res["breakdown"])]
    if "kernel_profile" in res:
        from engram_trt.bench.breakdown import format_kernel_profile

        lines += ["  " + line for line in format_kernel_profile(res["kernel_profile"])]
    lines.append(f"  run: {run.get('backend')}; graph shapes {run.get('graph_shapes')}")
    return lines


def svg_plot(results: list[dict[str, Any]], title: str) -> str:
    """bench serve's tokens/s against streams (both axes log2), one line per result."""
    import math

    W, H, L, B, R, T = 640, 400, 70, 50, 150, 40
    series = [
        (
            r["shape"],
            sorted((int(n), v["tokens_per_s"]) for n, v in r["serve"]["levels"].items() if v.get("tokens_per_s")),
        )
        for r in results
    ]
    pts = [p for _, s in series for p in s]
    if not pts:
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}">'
            '<text x="10" y="20">no figures</text></svg>'
        )
    xs = [math.log2(n) for n, _ in pts]
    ys = [math.log2(v) for _, v in pts]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = math.floor(min(ys)), math.ceil(max(max(ys), min(ys) + 1))

    def at(n: float, v: float) -> tuple[float, float]:
        return (
            L + (math.log2(n) - x0) / (x1 - x0) * (W - L - R),
            H - B - (math.log2(v) - y0) / (y1 - y0) * (H - B - T),
        )

    colors = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
        f'<text x="{L}" y="20">{title}</text>',
        f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
        f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
        f'<text x="{(W - R + L) / 2 - 20}" y="{H - 12}">streams</text>',
        f'<text x="8" y="{T - 8}">tokens/s</text>',
    ]
    for n in sorted({n for n, _ in pts}):
        x, _ = at(n, 2**y0)
        out.append(f'<text x="{x - 6:.1f}" y="{H - B + 16}">{n}</text>')
    for e in range(int(y0), int(y1) + 1):
        _, y = at(2**x0, 2**e)
        out.append(f'<text x="{L - 60}" y="{y + 4:.1f}">{2**e:,}</text>')
    for i, (name, s) in enumerate(series):
        c = colors[i % len(colors)]
        xy = [at(n, v) for n, v in s]
        out.append(
            f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
            + " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
            + '"/>'
        )
        out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{c}"/>' for x, y in xy]
        out.append(f'<text x="{W - R + 10}" y="{T + 18 * i + 10}" fill="{c}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def run(opts: E2eOptions) -> int:
    import torch

    from engram_trt.bench.common import dump, measure_limits

    if opts.device == "cuda" and not torch.cuda.is_available():
        raise EngramError("bench e2e --device cuda: no CUDA device is available here; use --device cpu for a smoke run")
    if not opts.concurrency or min(opts.concurrency) < 1:
        raise EngramError(f"--concurrency: expected positive integers, e.g. 1,8,32,64 (got {opts.concurrency})")
    if opts.path is not None and not Path(opts.path).is_dir():
        raise EngramError(f"--path {opts.path}: not a folder; pass a checkpoint folder")
    made = [s for s in opts.shapes if s in TRANSFORMERS_SHAPES] if opts.path is None else []
    if made:
        _need_transformers(f"bench e2e --shapes {','.join(made)} (it makes those checkpoints)")
    dev = torch.device(opts.device)
    t0 = time.perf_counter()
    limits = measure_limits(dev)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": opts.dtype,
        "limits": limits,
        "results": [],
    }
    if limits:
        print(
            f"{out['device']}: HBM copy {limits['hbm_GBps']:.0f} GB/s, bf16 {limits['bf16_TFLOPs']:.0f} TFLOP/s, "
            f"pinned H2D {limits['h2d_GBps']:.1f} GB/s (measured now)",
            flush=True,
        )
    tmp = None
    root = Path(opts.work_dir) if opts.work_dir else Path(tmp := tempfile.mkdtemp(prefix="engram-e2e-"))
    try:
        jobs = [(Path(opts.path), "path")] if opts.path else []
        for shape in [] if opts.path else opts.shapes:
            if shape == "demo":
                jobs.append((demo_checkpoint(), shape))
                continue
            folder = root / shape
            if not (folder / "config.json").is_file():
                t1 = time.perf_counter()
                make_checkpoint(shape, folder, device=opts.device, dtype=opts.dtype)
                print(
                    f"{shape}: checkpoint made by transformers in {time.perf_counter() - t1:.1f} s: {folder}",
                    flush=True,
                )
            jobs.append((folder, shape))
        for folder, shape in jobs:
            res = bench_folder(folder, shape, opts, limits)
            out["results"].append(res)
            print("\n".join(report(res)), flush=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"bench e2e: {out['seconds']} s")
    dump(out, opts.json)
    if opts.plot:
        Path(opts.plot).write_text(svg_plot(out["results"], f"bench serve, {out['device']}, {opts.dtype}"))
    return 0


__all__ = [
    "E2eOptions",
    "SHAPES",
    "decode_bytes",
    "make_checkpoint",
    "prompt_ids",
    "ratios",
    "run",
    "svg_plot",
    "transformers_config",
    "word_tokenizer",
]
