"""What the CPU runs natively: the vector and matrix instruction sets that decide which dtype
and which engine generate fastest on it (BENCHMARKS.md, "Rollout throughput", one table per
kind of CPU).

The kinds met on machines of this project's kind (2 cores each): an Intel Xeon with AMX
(``amx``: bf16 matrix tiles), an AMD EPYC or Xeon with AVX-512 and AVX512-BF16
(``avx512_bf16``), and an AMD EPYC with AVX2 only (``avx2``), where bf16 is emulated in fp32
(vLLM logs ``Failed to create oneDNN linear, fallback to torch linear`` there).
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

from treadle.core.errors import UserError

ISA_ENV = "TREADLE_CPU_ISA"
"""Caps the detected instruction sets at one kind (``avx2``, ``avx512``, ``avx512_bf16``,
``amx``) to see what treadle would choose on a lesser CPU. Only treadle's choices see the cap:
torch, oneDNN and vLLM still use what the CPU has."""
ORDER = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU this process runs on, as far as the dtype and engine choices need it."""

    model: str
    """The model name ``/proc/cpuinfo`` gives (``platform.processor()`` elsewhere)."""
    cores: int
    """Cores this process may run on (its affinity mask), not the machine's count."""
    avx2: bool
    avx512: bool
    """AVX-512 Foundation (``avx512f``)."""
    avx512_bf16: bool
    """AVX512-BF16: bf16 dot products in vector registers."""
    amx_bf16: bool
    """AMX with bf16 tiles (Sapphire Rapids and later): bf16 matmuls several times fp32's."""

    @property
    def native_bf16(self) -> bool:
        """Whether bf16 matmuls run in hardware (AVX512-BF16 or AMX); else they are emulated in
        fp32 and slower than fp32 itself."""
        return self.avx512_bf16 or self.amx_bf16

    @property
    def isa(self) -> str:
        """The best kind this CPU has, one of :data:`ORDER`."""
        have = (True, self.avx2, self.avx512, self.avx512_bf16, self.amx_bf16)
        return max((k for k, h in zip(ORDER, have, strict=True) if h), key=ORDER.index)

    def describe(self) -> str:
        """One line, e.g. ``Intel(R) Xeon(R) Processor, 2 cores, amx (bf16 native)``."""
        bf16 = "bf16 native" if self.native_bf16 else "bf16 emulated"
        return f"{self.model}, {self.cores} cores, {self.isa} ({bf16})"

    def as_dict(self) -> dict:
        """The fields and ``isa``, for ``summary.json`` and benchmark records."""
        return {**asdict(self), "isa": self.isa, "native_bf16": self.native_bf16}


def detect(cpuinfo: str | None = None, cap: str | None = None) -> CpuFeatures:
    """The features of this CPU from ``/proc/cpuinfo``'s flags (or the text ``cpuinfo``), capped
    at ``cap`` (default: the :data:`ISA_ENV` variable, if set). Without ``/proc/cpuinfo`` (not
    Linux) no feature is claimed.

    Raises:
        UserError: ``cap`` is not one of :data:`ORDER`.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = "", set()
    for line in cpuinfo.splitlines():  # the first processor's lines (all cores are alike)
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    cap = os.environ.get(ISA_ENV) if cap is None else cap
    if cap and cap not in ORDER:
        raise UserError(f"{ISA_ENV}={cap!r}: unknown; choose one of {', '.join(ORDER)}")
    top = ORDER.index(cap) if cap else len(ORDER) - 1
    allowed = set(ORDER[: top + 1])
    return CpuFeatures(
        model=model or platform.processor() or "CPU",
        cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1,
        avx2="avx2" in flags and "avx2" in allowed,
        avx512="avx512f" in flags and "avx512" in allowed,
        avx512_bf16="avx512_bf16" in flags and "avx512_bf16" in allowed,
        amx_bf16="amx_bf16" in flags and "amx" in allowed,
    )
