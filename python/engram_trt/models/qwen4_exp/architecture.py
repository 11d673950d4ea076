"""Qwen4Exp's declaration in the model registry: transformers' ``Qwen4ExpForCausalLM``
and the text model of ``Qwen4ExpForConditionalGeneration`` (the vision tower's tensors
are unused ones: refused with a line unless ``--allow-unused-weights``).

Its config fields' contract is :mod:`.config`'s; its PLE tables stay out of the module
(:mod:`.ple_tables`).
"""

from __future__ import annotations

from typing import Any, Mapping

from engram_trt.models.base import FLOAT_TABLE_DTYPES, ArchitectureBase
from engram_trt.models.qwen4_exp.config import CONTRACT, Qwen4ExpConfig, read_config

# The PLE shard dtypes an engine's EngramGather reads (safetensors spelling -> the export's
# table_dtype, onnx_export.PLE_TABLE_DTYPES): ArchitectureBase.table_dtype's float rows.
PLE_SHARD_DTYPES = FLOAT_TABLE_DTYPES


def ple_layout(config: Qwen4ExpConfig) -> Any:
    """The PLE hash layout of a config (its primes searched once per PLE spec)."""
    from engram_trt.models.qwen4_exp.ple_tables import ple_layout as layout_of

    return layout_of(config)


class Qwen4ExpArchitecture(ArchitectureBase):
    name = "qwen4-exp"
    architectures = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")
    model_types = ("qwen4_exp_text", "qwen4_exp")
    contract = CONTRACT
    title = "Qwen4Exp"  # the family in messages
    tensor_parallel = True  # --tp N: (linear-)attention heads, experts and vocabulary split (:mod:`.parallel`)

    def parallel_plan(self, config: Qwen4ExpConfig, tp: int, rank: int = 0) -> Any:
        """TP rank ``rank`` of ``tp``'s share (:mod:`.parallel`); refused in one line when the
        heads, the linear-attention heads or the experts do not divide."""
        from engram_trt.models.qwen4_exp.parallel import parallel_plan

        return parallel_plan(config, tp, rank)

    def read_config(
        self, d: Mapping[str, Any], source: str | None = None, *, enforce_contract: bool = True
    ) -> Qwen4ExpConfig:
        return read_config(d, source, enforce_contract=enforce_contract)

    def weight_shapes(self, config: Qwen4ExpConfig) -> dict[str, tuple[int, ...]]:
        from engram_trt.models.qwen4_exp.model import model_weight_shapes

        return model_weight_shapes(config)

    def tensor_names(self, config: Qwen4ExpConfig) -> set[str]:
        """Every tensor the model reads: its weights, and per PLE layer the table's shards
        and the buffers checked against the config."""
        from engram_trt.models.qwen4_exp.ple_tables import buffer_names, shard_names, table_scale_name

        names = set(self.weight_shapes(config))
        # The block scales of an FP8 checkpoint (transformers' save also writes a stale one
        # beside each linear it leaves in 16 bits: not read) and the experts' merged ones;
        # known whatever the config says, so that an FP8 weight whose config lost its
        # quantization_config is refused for that, by name (checkpoint_problems).
        from engram_trt.models.qwen4_exp.weights import MERGED_SCALES, expert_of
        from engram_trt.quant.names import scale_candidates

        for n in self.linear_names(config):
            names.update(scale_candidates(n))
            ex = expert_of(n)
            if ex is not None:
                names.update(f"{ex[0]}.{m}" for m in MERGED_SCALES.values())
        if config.tie_word_embeddings:
            names.update(scale_candidates("lm_head.weight"))
        if config.ple is not None:
            for layer in config.ple.layers:
                # every shard name a save may hold: those torch.chunk does not write are
                # refused by name (checkpoint_problems), not as unused tensors
                names.update(shard_names(config.weight_prefix, layer, config.ple.split_parts))
                names.update(buffer_names(config.weight_prefix, layer).values())
                names.add(table_scale_name(config.weight_prefix, layer))  # an FP8 table's (FP8Embedding)
        return names

    def linear_names(self, config: Qwen4ExpConfig) -> dict[str, str]:
        """Checkpoint weight name -> module path of every linear (what FP8 may store)."""
        from engram_trt.models.qwen4_exp.model import linear_weight_shapes

        return linear_weight_shapes(config)[1]

    def checkpoint_problems(self, ckpt: Any, layout: Any = None) -> list[str]:
        """One line per missing / misshapen weight and per PLE table problem (``layout``:
        unused, the PLE layout is the config's)."""
        from engram_trt.models.qwen4_exp.ple_tables import table_problems

        from engram_trt.checkpoint.checkpoint import FP8_WEIGHT_DTYPE, checkpoint_quant
        from engram_trt.errors import ConfigError
        from engram_trt.models.qwen4_exp.weights import fp8_problems

        cfg = ckpt.config
        out = []
        try:
            quant = checkpoint_quant(ckpt)
        except ConfigError as exc:
            return [str(exc)]
        shapes = self.weight_shapes(cfg)
        linears = self.linear_names(cfg)
        fp8 = fp8_problems(ckpt, cfg, linears, shapes, quant)
        for name, want in shapes.items():
            if name not in ckpt:
                out.append(f"tensor {name} is missing (expected shape {list(want)})")
            elif tuple(ckpt.shape(name)) != want:
                out.append(f"tensor {name} has shape {list(ckpt.shape(name))} but the config needs {list(want)}")
            elif name in fp8:
                out.append(fp8[name])
            elif ckpt.st_dtype(name) == FP8_WEIGHT_DTYPE and name not in linears:
                out.append(
                    f"tensor {name} is {ckpt.st_dtype(name)}, but only linear weights are served in FP8 "
                    f"(embeddings, norms, convolutions and the router are read as floats)"
                )
            elif not ckpt.dtype(name).is_floating_point:
                out.append(f"tensor {name} is {ckpt.st_dtype(name)}, not a float weight")
        if cfg.ple is not None:
            out.extend(table_problems(ckpt, cfg, ple_layout(cfg)))
        return out

    def describe_tables(self, ckpt: Any) -> dict[str, Any]:
        """What ``inspect`` reports of the PLE tables: per layer its shards, rows, width,
        dtype and bytes (the rows the config's primes give beside the rows found)."""
        from engram_trt.models.qwen4_exp.ple_tables import chunk_rows, table_scales, table_shard_names

        cfg = ckpt.config
        if cfg.ple is None:
            return {"ple": None, "note": "no PLE layers"}
        layout = ple_layout(cfg)
        layers, total = [], 0
        scales = table_scales(ckpt, cfg)
        for li, layer in enumerate(cfg.ple.layers):
            names = [n for n in table_shard_names(cfg, li, layout) if n in ckpt]
            chunk = chunk_rows(int(layout.table_rows[li]), cfg.ple.split_parts)
            nbytes = sum(int(ckpt.nbytes(n)) for n in names)
            total += nbytes
            layers.append(
                {
                    "ple_layer_id": layer + 1,
                    "layout_rows": int(layout.table_rows[li]),
                    "table_rows": sum(ckpt.shape(n)[0] for n in names),
                    "shards": len(names),
                    "split_ngram_parts": cfg.ple.split_parts,
                    # torch.chunk's shards: this many rows each, the last what is left
                    "chunk_rows": chunk[0] if chunk else None,
                    "last_shard_rows": chunk[-1] if chunk else None,
                    "width": cfg.ple.head_dim,
                    "dtype": ckpt.st_dtype(names[0]) if names else None,
                    "table_scale": scales[li],
                    "bytes": nbytes,
                }
            )
        return {
            "ple": {"layers": layers, "total_bytes": total, "heads": cfg.ple.n_heads, "ngram_size": cfg.ple.ngram_size}
        }

    def table_report_lines(self, report: Mapping[str, Any]) -> list[str]:
        """``inspect``'s lines of :meth:`describe_tables`' PLE report: the totals, then one
        line per PLE layer (none without PLE layers)."""
        from engram_trt.errors import human_bytes

        ple = report.get("ple")
        if not ple:
            return []
        lines = [
            (
                f"PLE          {len(ple['layers'])} layer(s), {ple['heads']} hashed heads of n-grams up to "
                f"{ple['ngram_size']}, {human_bytes(ple['total_bytes'])} of tables"
            )
        ]
        for e in ple["layers"]:
            lines.append(
                f"PLE layer {e['ple_layer_id']:>3}: {e['table_rows']} rows (the config's primes give "
                f"{e['layout_rows']}) x {e['width']} {e['dtype']} in {e['shards']} shard(s), "
                f"{human_bytes(e['bytes'])}"
            )
        return lines

    def engine_state_inputs(self, config: Qwen4ExpConfig) -> set[str]:
        """The exported step's per-slot states (``onnx_export.state_shapes``: conv,
        recurrent, KV and QSA index caches, PLE conv states) and its PLE inputs
        (``ple_context``, ``ple_table_ptrs``)."""
        from engram_trt.models.qwen4_exp.onnx_export import state_shapes

        return set(state_shapes(config)) | ({"ple_context", "ple_table_ptrs"} if config.ple is not None else set())

    def build_model(self, config: Qwen4ExpConfig, weights: Mapping[str, Any], **options: Any) -> Any:
        from engram_trt.models.qwen4_exp.model import Qwen4ExpModel

        return Qwen4ExpModel(config, weights, **options)

    def residual_streams(self, config: Qwen4ExpConfig) -> int:
        """``hc_count`` (its hyper-connection streams)."""
        return config.hc_count

    def has_own_tables(self, config: Qwen4ExpConfig) -> bool:
        """The PLE tables (``ple_layer_ids``)."""
        return config.ple is not None

    def table_refs(self, ckpt: Any) -> list[Any]:
        """Where the PLE tables' bytes are: one :class:`~engram_trt.tables.source.TableRef`
        per shard (``part`` in row order), what the runtime opens in the store
        ``--engram-config`` picks and checks as it checks Engram tables (empty without PLE)."""
        from engram_trt.models.qwen4_exp.ple_tables import ple_table_refs

        return [] if ckpt.config.ple is None else ple_table_refs(ckpt, ckpt.config, ple_layout(ckpt.config))

    def load_model(
        self,
        ckpt: Any,
        *,
        device: Any = "cpu",
        dtype: Any = None,
        ple_table_kind: str | None = None,
        tables: Any = None,
        engram_config: Any = None,
        parallel: Any = None,
        **_: Any,
    ) -> Any:
        """The model of an open checkpoint, its PLE tables bound from the checkpoint's
        shards: ``tables``, a table store the runtime opened over :meth:`table_refs`
        (left to it to close), else a store of ``ple_table_kind`` or the kind
        ``engram_config`` (default: the defaults) gives on ``device``
        (:func:`~engram_trt.tables.store.table_kind_for`: the file maps on a CPU); its
        ``hot_cache_fraction`` puts the hot-row cache in front of the tables. ``parallel``: a
        tensor-parallel rank's plan (the modules at its sizes, only its slices read; the PLE
        tables whole)."""
        import torch

        from engram_trt.models.qwen4_exp.model import Qwen4ExpModel
        from engram_trt.models.qwen4_exp.ple_tables import PLETables

        cfg = ckpt.config
        dev = torch.device(device)
        dtype = dtype or torch.float32
        from engram_trt.config.engram import EngramConfig

        ecfg = engram_config or EngramConfig()
        ple = None
        if cfg.ple is not None and tables is not None:
            from engram_trt.models.qwen4_exp.ple_tables import table_scales

            ple = PLETables(
                tables,
                dev,
                owns_store=False,
                hot_cache_fraction=ecfg.hot_cache_fraction,
                table_scales=table_scales(ckpt, cfg),
            )
        elif cfg.ple is not None:
            from engram_trt.tables.store import table_kind_for

            kind = ple_table_kind or table_kind_for(ecfg, dev)
            ple = PLETables.from_checkpoint(
                ckpt, cfg, ple_layout(cfg), kind=kind, device=dev, hot_cache_fraction=ecfg.hot_cache_fraction
            )
        # each tensor read from its shard when the model takes it (FP8 scales included; the
        # PLE shards are the table store's)
        if parallel is not None and parallel.sharded:
            from engram_trt.models.parallel import ShardedCheckpoint

            return Qwen4ExpModel(
                parallel.local_config,
                ShardedCheckpoint(ckpt, parallel).lazy(),
                ple_tables=ple,
                device=dev,
                dtype=dtype,
                parallel=parallel,
            )
        weights = ckpt.lazy()
        return Qwen4ExpModel(cfg, weights, ple_tables=ple, device=dev, dtype=dtype)

    def allocate_state(self, config: Qwen4ExpConfig, num_slots: int, max_len: int, device: Any, dtype: Any) -> Any:
        from engram_trt.models.qwen4_exp.state import Qwen4ExpState

        return Qwen4ExpState.allocate(config, num_slots, max_len, device, dtype)

    def engine_problems(self, ckpt: Any) -> list[str]:
        """What `engram-trt build` refuses before any work beyond :meth:`checkpoint_problems`:
        PLE shards the engine's EngramGather plugin cannot read. It reads BF16, F16 and F32
        rows of any width (F32 is what transformers' save_pretrained writes), one dtype per
        model, since the graph's gather nodes and the manifest name one table dtype."""
        from engram_trt.models.qwen4_exp.ple_tables import table_shard_names

        cfg = ckpt.config
        if cfg.ple is None:
            return []
        seen: dict[str, str] = {}
        for li in range(len(cfg.ple.layers)):
            for name in table_shard_names(cfg, li, ple_layout(cfg)):
                if name not in ckpt:
                    continue
                st = ckpt.st_dtype(name)
                if st == "F8_E4M3":
                    return [
                        f"FP8 PLE tables are not built into engines yet: PLE table shard {name} is F8_E4M3 (an "
                        f"FP8Embedding scaled per table, which the engine's EngramGather does not read); serve the "
                        f"checkpoint folder with the torch backend (engram-trt run / serve CHECKPOINT)"
                    ]
                if st not in PLE_SHARD_DTYPES:
                    return [
                        f"PLE table shard {name} is {st}: an engine's EngramGather plugin reads "
                        f"{' / '.join(PLE_SHARD_DTYPES)} rows; save the PLE shards in one of those to build, or "
                        f"serve the checkpoint folder with the torch backend (engram-trt run / serve)"
                    ]
                seen.setdefault(st, name)
        if len(seen) > 1:
            (a, first), (b, other) = list(seen.items())[:2]
            return [
                f"PLE table shards mix dtypes ({first} is {a}, {other} is {b}): an engine reads every PLE table "
                f"as one dtype; save all PLE shards as one of {' / '.join(PLE_SHARD_DTYPES)}"
            ]
        return []

    def export_onnx(self, config: Qwen4ExpConfig, weights: Any, layout: Any, options: Any) -> Any:
        """The ONNX serving step (:mod:`.onnx_export`); the PLE hash layout is the config's
        (``layout``, the builder's Engram layout, is None for this family)."""
        from engram_trt.models.qwen4_exp.onnx_export import export_model

        return export_model(config, weights, ple_layout(config) if config.ple is not None else None, options)

    def reference_ops(self) -> list[type]:
        """The ``onnx.reference`` OpRuns of this family's own plugin nodes (:mod:`.reference_ops`)."""
        from engram_trt.models.qwen4_exp.reference_ops import reference_ops

        return reference_ops()


ARCHITECTURE = Qwen4ExpArchitecture()
