"""Opening the tables: :func:`open_tables` picks the store for a kind (memory, device,
file, pinned, shared) and :func:`table_kind_for` the kind an ``--engram-config`` and a
device ask for. The stores themselves live below this module (``base``, ``pinned``,
``shared``), which never import it."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from engram_trt.errors import EngramError
from engram_trt.tables.base import (
    TABLE_KINDS,
    FileTables,
    TableStore,
    load_device_tables,  # noqa: F401
    load_memory_tables,
)
from engram_trt.tables.source import TableRef, check_table_files

log = logging.getLogger(__name__)


def table_kind_for(engram_config: Any, device: torch.device) -> str:
    """The store kind ``--engram-config`` asks for on ``device``: ``host_file_gather`` ->
    file, ``dp_shared_memory`` -> shared, ``cpu_offload: false`` -> device; otherwise
    pinned on a GPU, and the file map on a CPU (where nothing reads through UVA)."""
    if engram_config.host_file_gather:
        return "file"
    if device.type != "cuda":
        if not engram_config.cpu_offload:
            raise EngramError(
                "--engram-config cpu_offload=false puts the tables in GPU memory, but this runtime runs on a CPU; "
                "use a CUDA device or drop cpu_offload"
            )
        # No GPU reads the tables here, so a private copy buys nothing over the page
        # cache: map the files (nothing is loaded up front).
        return "shared" if engram_config.dp_shared_memory else "file"
    if not engram_config.cpu_offload:
        return "device"
    return "shared" if engram_config.dp_shared_memory else "pinned"


def open_tables(
    refs: Sequence[TableRef],
    kind: str,
    *,
    quant_block: int = 32,
    device: Any = "cpu",
    progress: bool = True,
    **options: Any,
) -> TableStore:
    """Open the tables ``refs`` describe in a store of ``kind`` (one of
    :data:`TABLE_KINDS`). Checks every file's size first, so a short or missing file
    fails before anything is loaded. ``options`` go to the pinned / shared stores."""
    if kind not in TABLE_KINDS:
        raise EngramError(f"table storage {kind!r} is not one of {', '.join(TABLE_KINDS)}")
    check_table_files(refs)
    device = torch.device(device)
    if kind in ("device", "pinned", "shared") and kind != "shared" and not torch.cuda.is_available():
        raise EngramError(
            f"table storage '{kind}' needs a CUDA device (none is available here); use 'memory' or 'file'"
        )
    if kind == "memory":
        store: TableStore = load_memory_tables(refs, quant_block, progress)
    elif kind == "file":
        store = FileTables(refs, quant_block)
    elif kind == "device":
        store = load_device_tables(
            refs, quant_block, device if device.type == "cuda" else torch.device("cuda"), progress
        )
    elif kind == "pinned":
        from engram_trt.tables.pinned import PinnedTables

        store = PinnedTables.load(refs, quant_block, progress=progress, **options)
    else:
        from engram_trt.tables.shared import SharedTables

        store = SharedTables.open(refs, quant_block, progress=progress, register=torch.cuda.is_available(), **options)
    log.info("Engram tables: %s, %.1f MiB in %s", store.kind, store.table_bytes() / 2**20, store.where())
    return store
