"""A stand-in for the CUDA host-memory registrar of the pinned table store (shared by the
tables and Qwen4Exp tables tests).
"""

from __future__ import annotations


class FakeRegistrar:
    """Records registrations; ``fail_at`` makes the n-th register call fail, ``shift``
    makes device pointers differ from host pointers (a system without UVA)."""

    name = "fake registrar"

    def __init__(self, fail_at: int | None = None, shift: int = 0) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.fail_at, self.shift = fail_at, shift

    def register(self, address: int, nbytes: int) -> None:
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            raise RuntimeError("cudaHostRegister: out of memory")
        self.registered.append((address, nbytes))

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)

    def device_pointer(self, address: int) -> int:
        return address + self.shift

    @property
    def live(self) -> set[int]:
        return {a for a, _ in self.registered} - set(self.unregistered)
