"""CPU feature detection from /proc/cpuinfo text (the three kinds met on these machines)."""

import pytest

from treadle.core.cpu import ORDER, detect
from treadle.core.errors import UserError

# Abridged flag lines of the three kinds of CPU met (lscpu on each).
AMX = "avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8"
AVX512_BF16 = "avx2 avx512f avx512bw avx512_bf16"  # an AMD EPYC (Zen 4)
AVX2 = "sse4_2 avx avx2 fma"  # an AMD EPYC without AVX-512


def cpuinfo(flags: str, model: str = "Test CPU") -> str:
    # two processors; only the first one's lines are read
    one = f"processor\t: 0\nmodel name\t: {model}\nflags\t\t: {flags}\n\n"
    return one + one.replace("processor\t: 0", "processor\t: 1")


@pytest.mark.parametrize(
    ("flags", "isa", "native"),
    [(AMX, "amx", True), (AVX512_BF16, "avx512_bf16", True), (AVX2, "avx2", False)],
)
def test_kinds(flags, isa, native):
    cpu = detect(cpuinfo(flags, "Intel(R) Xeon(R) Processor"), cap="")
    assert cpu.isa == isa
    assert cpu.native_bf16 is native
    assert cpu.model == "Intel(R) Xeon(R) Processor"
    assert cpu.as_dict()["isa"] == isa


def test_cap_hides_what_the_cpu_has():
    cpu = detect(cpuinfo(AMX), cap="avx2")
    assert (cpu.avx2, cpu.avx512, cpu.avx512_bf16, cpu.amx_bf16) == (True, False, False, False)
    assert cpu.describe().endswith("avx2 (bf16 emulated)")
    # a cap above what the CPU has adds nothing
    assert detect(cpuinfo(AVX2), cap="amx").isa == "avx2"


def test_cap_from_the_environment(monkeypatch):
    monkeypatch.setenv("TREADLE_CPU_ISA", "avx512")
    assert detect(cpuinfo(AMX)).isa == "avx512"
    monkeypatch.setenv("TREADLE_CPU_ISA", "sse")
    with pytest.raises(UserError, match="TREADLE_CPU_ISA='sse'"):
        detect(cpuinfo(AMX))


def test_no_cpuinfo_claims_nothing():
    cpu = detect("", cap="")
    assert cpu.isa == ORDER[0] and not cpu.native_bf16 and cpu.cores >= 1
