"""Engram table storage: one interface (:class:`~engram_trt.tables.base.TableStore`)
over every place the tables can live.

Tables are the one part of an Engram model that does not fit an engine or, for real
models, a GPU (about 200 GB for a DeepSeek-V4.1-Flash-sized model), so the runtime
chooses where they live and the rest of the stack sees only per-layer row and scale
tensors plus what kind of memory holds them:

| kind | module | where | chosen by (``--engram-config``) |
| --- | --- | --- | --- |
| ``memory`` | :mod:`.base` | ordinary host memory (the CPU reference) | no GPU |
| ``device`` | :mod:`.base` | GPU memory | ``cpu_offload: false`` |
| ``pinned`` | :mod:`.pinned` | host memory registered for UVA, in chunks | default with a GPU |
| ``shared`` | :mod:`.shared` | one ``/dev/shm`` segment per node, every process attaches | ``dp_shared_memory`` |
| ``file`` | :mod:`.base` | the checkpoint files through the page cache | ``host_file_gather`` |

:func:`open_tables` is the one factory; :mod:`.source` says where each table's bytes
are on disk (from a checkpoint or an engine folder's manifest) and checks them.
:mod:`.hostmem` holds what the pinned and shared stores share (huge-page allocation,
chunked CUDA registration); :mod:`.segment` the shared segment's format and the
``engram-trt shm`` inspection, importable without torch.

The names below are imported on first use, so ``engram-trt shm`` (which needs only
:mod:`.segment`) does not pay for importing torch.
"""

from typing import Any

from engram_trt.tables.source import TableRef, check_table_files, layer_refs  # noqa: F401

_LAZY = {"TABLE_KINDS": "base", "TableStore": "base", "open_tables": "store", "table_kind_for": "store"}
__all__ = ["TableRef", "check_table_files", "layer_refs", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"engram_trt.tables.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'engram_trt.tables' has no attribute {name!r}")
