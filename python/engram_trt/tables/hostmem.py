"""Host memory the GPU reads through UVA: anonymous buffers with huge pages where the
system has them, a table layout inside one buffer, and CUDA host registration in
chunks. Shared by the pinned store (:mod:`.pinned`, private anonymous memory) and the
shared store (:mod:`.shared`, a ``/dev/shm`` file mapped by every process).

Why chunks: one ``cudaHostRegister`` of hundreds of GiB fails on real systems (the
driver pins and maps the range in one call, and large single registrations hit
per-call limits and take minutes with nothing to show); 1 GiB registrations succeed,
let a failure name the chunk, and let the caller roll back what it registered.

Why a registrar object: registration is the only step here that needs a GPU. Every
other step (allocation, the layout, the reads, the chunk arithmetic, the rollback,
the unregistration on close) runs on a CPU-only machine when a fake registrar stands
in, which is how the test suite covers this path; :class:`CudaRegistrar` is the real
one, through PyTorch's ``torch.cuda.cudart()`` where PyTorch exposes the call, else
``cuda.bindings.runtime`` (cuda-python), else the project's kernel library.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

from engram_trt.errors import human_bytes
from engram_trt.errors import EngramError
from engram_trt.tables.source import TableRef, layer_refs

log = logging.getLogger(__name__)

GiB = 1 << 30
HUGE_PAGE = 2 * 1024 * 1024  # x86-64 / arm64 (4 KiB base pages) PMD size
DATA_ALIGN = HUGE_PAGE  # each table starts on a huge-page boundary
DEFAULT_CHUNK_BYTES = GiB
PAGE = mmap.PAGESIZE
HUGE_PAGE_MODES = ("auto", "hugetlbfs", "hugetlbfs-1g", "thp", "none")
GIGA_PAGE = 1 << 30
_MAP_HUGE_1GB = 30 << 26  # MAP_HUGE_SHIFT = 26: log2 of the page size in the flags
_GIGA_POOL = Path("/sys/kernel/mm/hugepages/hugepages-1048576kB")

# Linux's flag values; Python's mmap module lacks MAP_HUGETLB before 3.12.
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_DONTNEED_FILE = getattr(os, "POSIX_FADV_DONTNEED", 4)
CUDA_HOST_REGISTER_PORTABLE = 0x01
CUDA_HOST_REGISTER_MAPPED = 0x02
REGISTER_FLAGS = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED


def round_up(n: int, to: int) -> int:
    return (int(n) + to - 1) // to * to


# ------------------------------------------------------------------ table layout
@dataclass(frozen=True)
class PlacedTable:
    """One table tensor's place in a buffer: bytes ``[offset, offset + ref.nbytes)``."""

    ref: TableRef
    offset: int


def ordered_refs(refs: Sequence[TableRef]) -> list[TableRef]:
    """The refs in layer order, rows before scales (the order every store lays them out)."""
    out: list[TableRef] = []
    for rows, scales in layer_refs(refs):
        out.append(rows)
        if scales is not None:
            out.append(scales)
    return out


def plan_layout(refs: Sequence[TableRef], start: int = 0, align: int = DATA_ALIGN) -> tuple[list[PlacedTable], int]:
    """Place every table in one buffer from byte ``start``, each on an ``align``
    boundary (huge pages then hold one table each, and a GPU read never straddles two
    tables' pages). Returns the placements and the buffer size (a multiple of ``align``)."""
    placed: list[PlacedTable] = []
    pos = round_up(start, align)
    for ref in ordered_refs(refs):
        placed.append(PlacedTable(ref, pos))
        pos = round_up(pos + ref.nbytes, align)
    return placed, max(pos, align)


# ------------------------------------------------------------------ allocation
@dataclass
class HostBuffer:
    """An anonymous private mapping; the usable bytes are ``[base, base + nbytes)`` of
    ``mm`` (``base`` moves the start to a huge-page boundary for transparent huge pages)."""

    mm: mmap.mmap
    base: int
    nbytes: int
    pages: str  # how the memory is paged, in words (logged, and shown by describe())

    @property
    def address(self) -> int:
        return mapping_address(self.mm) + self.base


def mapping_address(mm: mmap.mmap) -> int:
    """The virtual address of a mapping's first byte. The ctypes view exists only
    inside this call: a live export would make ``mm.close()`` fail."""
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    return out


def hugetlb_free_bytes() -> tuple[int, int]:
    """(free reserved hugetlbfs bytes, their page size) of the default huge page pool."""
    info = _meminfo()
    size = info.get("Hugepagesize", 0)
    return info.get("HugePages_Free", 0) * size, size


def giga_pages_free() -> int:
    """Free reserved 1 GiB huge pages (0 where the kernel has no such pool)."""
    try:
        return int((_GIGA_POOL / "free_hugepages").read_text())
    except (OSError, ValueError):
        return 0


def map_giga_pages(nbytes: int) -> mmap.mmap:
    """Private anonymous memory in reserved 1 GiB huge pages (``MAP_HUGETLB |
    MAP_HUGE_1GB``): a 24 GiB table then needs 24 TLB entries, where 2 MiB pages need
    12,288 and the CPU gather pays a page walk on most random rows. Raises EngramError
    naming the reservation to make when too few are free."""
    need = round_up(nbytes, GIGA_PAGE)
    free = giga_pages_free()
    if free * GIGA_PAGE < need:
        raise EngramError(
            f"1 GiB huge pages: {need // GIGA_PAGE} needed, {free} free; reserve them "
            f"(echo {need // GIGA_PAGE} > {_GIGA_POOL}/nr_hugepages, as root) or use another huge_pages mode"
        )
    try:
        return mmap.mmap(-1, need, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB | _MAP_HUGE_1GB)
    except OSError as exc:
        raise EngramError(
            f"MAP_HUGETLB | MAP_HUGE_1GB of {human_bytes(need)} failed ({exc.strerror}); "
            f"check {_GIGA_POOL}/free_hugepages"
        ) from None


def thp_mode() -> str:
    """The transparent-huge-page policy: 'always', 'madvise', 'never' or 'unknown'."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unknown"


def allocate_anonymous(nbytes: int, huge_pages: str = "auto") -> HostBuffer:
    """Private anonymous memory for ``nbytes`` bytes, huge pages asked for where the
    system allows: reserved 1 GiB pages when enough are free (and the buffer is at least
    half a GiB), else hugetlbfs pages of the default size when enough are reserved (``MAP_HUGETLB``), else
    transparent huge pages (``madvise(MADV_HUGEPAGE)`` on a 2 MiB-aligned range), else
    base pages. ``huge_pages`` forces one mode ('hugetlbfs' fails if none are free).
    Which one took is logged and kept in :attr:`HostBuffer.pages`."""
    if huge_pages not in HUGE_PAGE_MODES:
        raise EngramError(f"huge_pages={huge_pages!r} is not one of {', '.join(HUGE_PAGE_MODES)}")
    if nbytes <= 0:
        raise EngramError(f"internal: host buffer of {nbytes} bytes")
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if huge_pages == "hugetlbfs-1g" or (
        huge_pages == "auto"
        and nbytes >= GIGA_PAGE // 2
        and giga_pages_free() * GIGA_PAGE >= round_up(nbytes, GIGA_PAGE)
    ):
        try:
            mm = map_giga_pages(nbytes)
        except EngramError as exc:
            if huge_pages == "hugetlbfs-1g":
                raise
            # auto: another process may have taken the free pages since they were counted
            log.info("%s; trying the other huge pages", exc)
        else:
            log.info("tables' host memory: %s in hugetlbfs 1 GiB pages", human_bytes(len(mm)))
            return HostBuffer(mm, 0, nbytes, "hugetlbfs 1 GiB pages")
    if huge_pages in ("auto", "hugetlbfs"):
        free, size = hugetlb_free_bytes()
        need = round_up(nbytes, size) if size else 0
        if size and free >= need:
            try:
                mm = mmap.mmap(-1, need, flags=private | _MAP_HUGETLB)
                pages = f"hugetlbfs {human_bytes(size)} pages"
                log.info("tables' host memory: %s in %s", human_bytes(need), pages)
                return HostBuffer(mm, 0, nbytes, pages)
            except OSError as exc:
                if huge_pages == "hugetlbfs":
                    raise EngramError(
                        f"MAP_HUGETLB of {human_bytes(need)} failed ({exc.strerror}); "
                        "reserve more huge pages (/proc/sys/vm/nr_hugepages) or use huge_pages='auto'"
                    ) from None
                log.info(
                    "MAP_HUGETLB of %s failed (%s); trying transparent huge pages", human_bytes(need), exc.strerror
                )
        elif huge_pages == "hugetlbfs":
            raise EngramError(
                f"huge_pages='hugetlbfs' needs {human_bytes(need or nbytes)} of reserved huge pages but "
                f"{human_bytes(free)} are free; reserve them (/proc/sys/vm/nr_hugepages) or use huge_pages='auto'"
            )
    if huge_pages in ("auto", "thp"):
        mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=private)
        base = (-mapping_address(mm)) % HUGE_PAGE
        mode = thp_mode()
        if mode == "never":
            pages = "4 KiB pages (transparent huge pages are disabled)"
        else:
            try:
                mm.madvise(_MADV_HUGEPAGE, 0, len(mm))
                pages = f"transparent huge pages (policy {mode})"
            except (OSError, ValueError) as exc:
                pages = f"4 KiB pages (madvise(MADV_HUGEPAGE) refused: {exc})"
        log.info("tables' host memory: %s in %s", human_bytes(nbytes), pages)
        return HostBuffer(mm, base, nbytes, pages)
    mm = mmap.mmap(-1, nbytes, flags=private)
    log.info("tables' host memory: %s in base pages (huge pages not asked for)", human_bytes(nbytes))
    return HostBuffer(mm, 0, nbytes, f"{PAGE // 1024} KiB pages")


def drop_page_cache(ref: TableRef) -> None:
    """Tell the kernel the table's file range need not stay cached: once copied into
    pinned or shared memory, a second copy in the page cache only crowds out RAM."""
    for part in ref.parts:
        try:
            fd = os.open(part.file, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, part.offset, part.nbytes, _MADV_DONTNEED_FILE)
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)


def tensors_over(buffer: Any, placed: Sequence[PlacedTable], base: int = 0) -> list[tuple[Any, Any]]:
    """Per layer ``(rows, scales or None)`` torch tensors viewing ``buffer`` (an mmap)
    at each placement, shaped as the stores hand them out (no copy)."""
    import warnings

    import torch

    from engram_trt.tables.base import _shape_tensor

    by_layer: dict[int, dict[str, Any]] = {}
    with warnings.catch_warnings():  # a read-only mapping is fine: nothing writes through these views
        warnings.simplefilter("ignore", UserWarning)
        for p in placed:
            flat = torch.frombuffer(buffer, dtype=torch.uint8, count=p.ref.nbytes, offset=base + p.offset)
            by_layer.setdefault(p.ref.layer_index, {})[p.ref.role] = _shape_tensor(flat, p.ref)
    return [(by_layer[i]["rows"], by_layer[i].get("scales")) for i in sorted(by_layer)]


# ------------------------------------------------------------------ registration
class Registrar(Protocol):
    """What host registration needs from a CUDA binding (a fake one in the tests)."""

    name: str

    def register(self, address: int, nbytes: int) -> None: ...

    def unregister(self, address: int) -> None: ...

    def device_pointer(self, address: int) -> int: ...


def chunk_ranges(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` pieces covering ``[0, nbytes)`` exactly once, each
    ``chunk_bytes`` long but the last."""
    if chunk_bytes <= 0 or chunk_bytes % PAGE:
        raise EngramError(
            f"registration chunk of {chunk_bytes} bytes must be a positive multiple of the page size ({PAGE})"
        )
    return [(off, min(chunk_bytes, nbytes - off)) for off in range(0, int(nbytes), int(chunk_bytes))]


@dataclass
class HostRegistration:
    """A host range registered chunk by chunk; :meth:`release` undoes every chunk."""

    registrar: Registrar
    address: int
    nbytes: int
    chunk_bytes: int
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (address, length) registered

    @classmethod
    def register(
        cls,
        registrar: Registrar,
        address: int,
        nbytes: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        what: str = "tables",
    ) -> "HostRegistration":
        """Register ``[address, address + nbytes)`` in chunks and check that the GPU sees
        each chunk at its host address (UVA). On any failure the chunks registered so
        far are unregistered and an EngramError names the chunk."""
        reg = cls(registrar, int(address), int(nbytes), int(chunk_bytes))
        pieces = chunk_ranges(nbytes, chunk_bytes)
        for i, (off, length) in enumerate(pieces):
            at = reg.address + off
            try:
                registrar.register(at, length)
            except Exception as exc:  # noqa: BLE001 - any binding's failure becomes one line
                reg.release()
                raise EngramError(
                    f"registering the {what}' host memory for the GPU failed at chunk {i + 1} of {len(pieces)} "
                    f"({human_bytes(length)} at offset {off}): {exc}; make sure the machine has "
                    f"{human_bytes(nbytes)} of free RAM (registered memory cannot be swapped), or use "
                    f"--engram-config host_file_gather=true (no copy) or cpu_offload=false (GPU memory)"
                ) from None
            reg.chunks.append((at, length))
            try:
                dev = registrar.device_pointer(at)
            except Exception as exc:  # noqa: BLE001
                reg.release()
                raise EngramError(
                    f"cannot ask the CUDA driver where the GPU sees the {what}' host memory ({exc}); "
                    "install cuda-python (pip install cuda-python) or use --engram-config cpu_offload=false"
                ) from None
            if int(dev) != at:
                reg.release()
                raise EngramError(
                    f"the GPU sees the {what}' registered host memory at {int(dev):#x}, "
                    f"not at its host address {at:#x}: this system has no unified virtual addressing (UVA), "
                    "which reading host tables on the GPU needs; "
                    "use --engram-config cpu_offload=false (tables in GPU memory) or host_file_gather=true"
                )
        log.info(
            "registered %s of %s for the GPU in %d chunk%s of %s through %s",
            human_bytes(nbytes),
            what,
            len(pieces),
            "s" if len(pieces) != 1 else "",
            human_bytes(chunk_bytes),
            registrar.name,
        )
        return reg

    def release(self) -> None:
        """Unregister every chunk (newest first). Errors are logged, not raised: this runs
        from close(), the garbage collector and process exit."""
        while self.chunks:
            at, length = self.chunks.pop()
            try:
                self.registrar.unregister(at)
            except Exception as exc:  # noqa: BLE001
                log.warning("unregistering %s of host memory at %#x failed: %s", human_bytes(length), at, exc)


class CudaRegistrar:
    """``cudaHostRegister(ptr, len, Portable | Mapped)`` / ``cudaHostUnregister`` /
    ``cudaHostGetDevicePointer`` through the first binding that has each call:
    ``torch.cuda.cudart()`` (register, unregister; PyTorch has no device-pointer call),
    ``cuda.bindings.runtime`` or the older ``cuda.cudart`` (cuda-python), the project's
    kernel library (register, unregister), or the CUDA runtime already loaded in this
    process through ctypes (device pointer)."""

    def __init__(self) -> None:
        self._torch = self._cuda_python = self._kernels = self._ctypes_rt = None
        try:
            import torch

            rt = torch.cuda.cudart()
            if hasattr(rt, "cudaHostRegister") and hasattr(rt, "cudaHostUnregister"):
                self._torch = rt
        except Exception as exc:  # noqa: BLE001 - no CUDA build, no device: try the next binding
            log.debug("torch.cuda.cudart() unavailable: %s", exc)
        for module in ("cuda.bindings.runtime", "cuda.cudart"):
            try:
                import importlib

                self._cuda_python = importlib.import_module(module)
                self._cuda_python_name = module
                break
            except ImportError:
                continue
        if self._torch is None and self._cuda_python is None:
            try:
                from engram_trt.native import library as kernel_library

                self._kernels = kernel_library.load_library()
            except EngramError as exc:
                raise EngramError(
                    "no CUDA binding can register host memory (PyTorch has no CUDA, "
                    f"cuda-python is not installed, and {exc})"
                ) from None
        if self._cuda_python is None:
            self._ctypes_rt = _loaded_cudart()
        via = (
            "torch.cuda.cudart"
            if self._torch is not None
            else self._cuda_python_name
            if self._cuda_python is not None
            else "the engram-trt kernel library"
        )
        ptr_via = (
            self._cuda_python_name
            if self._cuda_python is not None
            else "the process's libcudart"
            if self._ctypes_rt is not None
            else "nothing"
        )
        self.name = via if ptr_via == via else f"{via} (device pointers through {ptr_via})"

    def register(self, address: int, nbytes: int) -> None:
        if self._torch is not None:
            rt = self._torch
            res = rt.cudaHostRegister(int(address), int(nbytes), REGISTER_FLAGS)
            if res != rt.cudaError.success:
                _clear_cuda_error(self._ctypes_rt)
                raise RuntimeError(f"cudaHostRegister: {rt.cudaGetErrorString(res)}")
        elif self._cuda_python is not None:
            self._check(
                self._cuda_python.cudaHostRegister(int(address), int(nbytes), REGISTER_FLAGS), "cudaHostRegister"
            )
        else:
            assert self._kernels is not None
            if self._kernels.engram_host_register(ctypes.c_void_p(int(address)), ctypes.c_size_t(int(nbytes))) != 0:
                raise RuntimeError(self._kernels.engram_last_error().decode())

    def unregister(self, address: int) -> None:
        if self._torch is not None:
            rt = self._torch
            res = rt.cudaHostUnregister(int(address))
            if res != rt.cudaError.success:
                raise RuntimeError(f"cudaHostUnregister: {rt.cudaGetErrorString(res)}")
        elif self._cuda_python is not None:
            self._check(self._cuda_python.cudaHostUnregister(int(address)), "cudaHostUnregister")
        else:
            assert self._kernels is not None
            if self._kernels.engram_host_unregister(ctypes.c_void_p(int(address))) != 0:
                raise RuntimeError(self._kernels.engram_last_error().decode())

    def device_pointer(self, address: int) -> int:
        if self._cuda_python is not None:
            out = self._cuda_python.cudaHostGetDevicePointer(int(address), 0)
            self._check(out, "cudaHostGetDevicePointer")
            return int(out[1])
        if self._ctypes_rt is not None:
            dev = ctypes.c_void_p()
            status = self._ctypes_rt.cudaHostGetDevicePointer(ctypes.byref(dev), ctypes.c_void_p(int(address)), 0)
            if status != 0:
                raise RuntimeError(f"cudaHostGetDevicePointer: CUDA error {status}")
            return int(dev.value or 0)
        raise RuntimeError("neither cuda-python nor a loaded libcudart offers cudaHostGetDevicePointer")

    def _check(self, result: Any, call: str) -> None:
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != 0:
            rt = self._cuda_python
            try:
                msg = rt.cudaGetErrorString(err)[1]
                msg = msg.decode() if isinstance(msg, bytes) else str(msg)
            except Exception:  # noqa: BLE001
                msg = f"CUDA error {int(err)}"
            raise RuntimeError(f"{call}: {msg}")


def _clear_cuda_error(lib: Any = None) -> None:
    """Reset the runtime's last error after a refused registration: the CUDA runtime keeps
    it, and the next unrelated CUDA call in the process (a torch kernel) would report it
    as its own failure."""
    lib = lib or _loaded_cudart()
    if lib is not None and hasattr(lib, "cudaGetLastError"):
        lib.cudaGetLastError()


def _loaded_cudart() -> Any:
    """The CUDA runtime library this process already loaded (PyTorch's), through ctypes."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if "libcudart.so" in Path(path).name:
                lib = ctypes.CDLL(path)
                lib.cudaHostGetDevicePointer.argtypes = [
                    ctypes.POINTER(ctypes.c_void_p),
                    ctypes.c_void_p,
                    ctypes.c_uint,
                ]
                lib.cudaHostGetDevicePointer.restype = ctypes.c_int
                return lib
    except (OSError, AttributeError):
        pass
    return None
