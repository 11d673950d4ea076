"""The pinned store (``kind='pinned'``, the default with a GPU): the tables copied once
into this process's host memory, registered with the CUDA driver so GPU kernels read
them in place through UVA (the in-engine gather), while the host gather reads the same
bytes on the CPU.

Why not ``torch.empty(..., pin_memory=True)``: PyTorch's pinned allocator rounds to
powers of two and pins the whole block in one call. For a table set of hundreds of GiB
that wastes up to half of it and the single registration fails on real systems; this
store maps exactly the bytes it needs (huge pages where the system allows, see
:func:`~engram_trt.tables.hostmem.allocate_anonymous`), reads each table's byte range
straight into it (no second copy, a byte progress bar for multi-GiB loads), and
registers it in 1 GiB chunks (:class:`~engram_trt.tables.hostmem.HostRegistration`).

Lifetime: :meth:`PinnedTables.close` (or ``with``) unregisters every chunk and unmaps
the memory; the same happens when the store is garbage-collected or the process exits.
Nothing outlives the process: a restart reads the tables again (use the shared store,
:mod:`.shared`, to re-attach in seconds instead).
"""

from __future__ import annotations

import logging
import mmap
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from engram_trt.errors import human_bytes
from engram_trt.tables.hostmem import (
    DEFAULT_CHUNK_BYTES,
    HostBuffer,
    HostRegistration,
    PlacedTable,
    Registrar,
    allocate_anonymous,
    drop_page_cache,
    plan_layout,
    tensors_over,
)
from engram_trt.tables.source import TableRef, layer_refs
from engram_trt.tables.base import TableStore, _load_progress, read_region_into

log = logging.getLogger(__name__)

Reader = Callable[[TableRef, Any, Any], None]  # (ref, flat uint8 tensor, progress bar) -> None


@dataclass
class HostResources:
    """What a host-memory store must give back: a registration and a mapping. Kept
    apart from the store so a ``weakref.finalize`` can release it without keeping the
    store alive."""

    mm: mmap.mmap | None
    registration: HostRegistration | None = None

    def release(self) -> None:
        if self.registration is not None:
            self.registration.release()
            self.registration = None
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                # A caller still holds a tensor viewing the memory: it stays mapped
                # (unregistered) until that tensor goes; never unmapped under a live view.
                log.debug(
                    "a view of the tables' host memory is still referenced; "
                    "unmapping it is left to the garbage collector"
                )
            self.mm = None


class PinnedTables(TableStore):
    """Tables in this process's host memory, registered for UVA in chunks."""

    kind = "pinned"
    gpu_readable = True

    def __init__(
        self,
        layers: Sequence[tuple[Any, Any]],
        quant_block: int,
        layer_ids: Sequence[int],
        resources: HostResources,
        buffer: HostBuffer,
        placed: Sequence[PlacedTable],
    ) -> None:
        super().__init__(layers, quant_block, layer_ids)
        self._resources = resources
        self._finalizer = weakref.finalize(self, resources.release)
        self.buffer_bytes = buffer.nbytes
        self.pages = buffer.pages
        self.address = buffer.address
        self.placed = list(placed)
        reg = resources.registration
        self.chunks = list(reg.chunks) if reg is not None else []
        self.registrar_name = reg.registrar.name if reg is not None else None

    @classmethod
    def load(
        cls,
        refs: Sequence[TableRef],
        quant_block: int = 32,
        *,
        progress: bool = True,
        registrar: Registrar | None = None,
        allocator: Callable[[int], HostBuffer] | None = None,
        reader: Reader | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        huge_pages: str = "auto",
        drop_cache: bool = True,
    ) -> "PinnedTables":
        """Allocate, read every table's byte range, register, and return the store.

        The three steps are injectable so the whole path runs without a GPU:
        ``allocator(nbytes) -> HostBuffer`` (default: anonymous memory with huge pages,
        ``huge_pages`` says which), ``reader(ref, flat_uint8_tensor, progress_bar)``
        (default: chunked file reads), ``registrar`` (default:
        :class:`~engram_trt.tables.hostmem.CudaRegistrar`). ``drop_cache`` advises the
        kernel to drop each table's file pages once copied (the page cache would
        otherwise hold a second copy)."""
        from engram_trt.tables.hostmem import CudaRegistrar

        pairs = layer_refs(refs)
        placed, total = plan_layout(refs)
        buffer = (allocator or (lambda n: allocate_anonymous(n, huge_pages)))(total)
        resources = HostResources(buffer.mm)
        views: list[tuple[Any, Any]] = []
        try:
            read = reader or read_region_into
            views = tensors_over(buffer.mm, placed, base=buffer.base)
            with _load_progress(refs, "pinned", progress) as bar:
                fill_tables(views, placed, read, bar, drop_cache)
            reg = registrar if registrar is not None else CudaRegistrar()
            resources.registration = HostRegistration.register(
                reg, buffer.address, buffer.nbytes, chunk_bytes, what="pinned tables"
            )
        except BaseException:
            views.clear()  # the views export the mapping; drop them so it can be unmapped
            resources.release()
            raise
        return cls(views, quant_block, [r.layer_id for r, _ in pairs], resources, buffer, placed)

    # -- accounting ----------------------------------------------------------------
    def nbytes(self) -> int:
        return 0 if self._closed else self.buffer_bytes

    def where(self) -> str:
        n = len(self.chunks)
        return (
            f"pinned host memory ({human_bytes(self.buffer_bytes)}, {self.pages}; registered for UVA in {n} "
            f"chunk{'s' if n != 1 else ''} through {self.registrar_name})"
        )

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(pages=self.pages, buffer_bytes=self.buffer_bytes, registered_chunks=len(self.chunks))
        return d

    def close(self) -> None:
        """Unregister every chunk and unmap (idempotent)."""
        super().close()
        self._finalizer()
        self.chunks = []


def fill_tables(
    views: Sequence[tuple[Any, Any]], placed: Sequence[PlacedTable], read: Reader, bar: Any, drop_cache: bool
) -> None:
    """Read every placed table into its view (``tensors_over``'s result for the same
    placements), advancing ``bar`` by bytes."""
    import torch

    by_key = {
        (li, role): t for li, (rows, scales) in enumerate(views) for role, t in (("rows", rows), ("scales", scales))
    }
    for p in placed:
        t = by_key[(p.ref.layer_index, p.ref.role)]
        read(p.ref, t.view(torch.uint8).reshape(-1), bar)
        if drop_cache:
            drop_page_cache(p.ref)
