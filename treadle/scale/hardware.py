"""GPU types: datasheet figures, and the efficiencies that turn them into seconds.

One :class:`Gpu` per type; nothing is fitted per experiment. The datasheet figures are dense
bf16 tensor throughput, HBM bandwidth and interconnects (NVIDIA's H100/H800/H20/H200/A100
datasheets); the efficiencies are one set for all GPUs of the generation (SCALE.md says how
they were chosen and what each published figure then gives).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from treadle.core.errors import UserError
from treadle.scale.values import number

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Efficiency:
    """What fraction of a datasheet figure real kernels reach, and fixed latencies."""

    train_mfu: float = 0.40
    """Model FLOPs utilisation of a training pass with enough tokens per GPU (FSDP/Megatron,
    bf16, flash attention; torchtitan reports 38-44% on H100 for Llama 3.1 8B)."""
    train_half_tokens: float = 4096.0
    """Tokens per GPU per pass at which a training pass reaches half its MFU: small batches
    leave the GPU waiting on collectives and launches (a saturating curve t / (t + this))."""
    prefill_mfu: float = 0.50
    decode_bandwidth: float = 0.65
    """Fraction of HBM bandwidth a decode step reaches reading weights and KV cache."""
    decode_mfu: float = 0.45
    """Ceiling of decode FLOPs utilisation, reached at large batches."""
    layer_latency_s: float = 40e-6
    """Fixed time per layer per decode step (kernel launches, CUDA graphs' floor, TP
    all-reduce latency): what a batch-1 step costs beyond its bytes."""
    step_floor_s: float = 0.0
    """Least seconds a decode step takes whatever its batch: the engine's own work per step
    (scheduling, sampling, Python) where the model is too small to hide it, as on a CPU (0 on
    GPUs, whose floor is ``layer_latency_s``)."""
    token_overhead_s: float = 0.0
    """Seconds per token of a decode step's batch beyond its FLOPs (sampling, detokenizing,
    bookkeeping per sequence): 0 on GPUs, where it overlaps the kernels."""
    kv_memory_fraction: float = 0.85
    """GPU memory an engine may use (vLLM's gpu_memory_utilization)."""
    max_batch: int = 256
    """Requests one engine decodes at once at most (vLLM's max_num_seqs)."""
    train_overhead_s: float = 0.0
    """Fixed seconds per update beyond its FLOPs (the optimizer step, launches, Python): 0 on
    GPUs at the batch sizes RL uses, where the MFU curve stands for it."""
    sync_overhead_s: float = 2.0
    """Fixed cost of one weight update of the engines: pause, flush the KV cache, resume."""
    interconnect: float = 0.7
    """Fraction of link bandwidth a collective reaches."""
    network_hop_s: float = 5e-6
    """Latency a collective adds per network hop between nodes (NCCL's tuning model,
    ``src/graph/tuning.cc``: tree algorithm, LL protocol, network hardware); the hops within a
    node are in ``layer_latency_s``."""
    pcie_gbps: float = 25.0
    """Host <-> GPU copies, GB/s (offloading in a colocated placement)."""

    def __post_init__(self) -> None:
        """Raises UserError naming a field out of its range: fractions of a datasheet figure
        above 0 (the FLOPs utilisations folded into calibrated rates may exceed 1: see
        :mod:`.calibrate`), latencies of 0..3,600 s, a batch of at least one request."""
        for name in ("train_mfu", "decode_bandwidth", "kv_memory_fraction", "interconnect"):
            number(f"Efficiency.{name}", getattr(self, name), 0, 1, above=True)
        for name in ("prefill_mfu", "decode_mfu", "pcie_gbps"):
            number(f"Efficiency.{name}", getattr(self, name), 0, above=True)
        for name in ("layer_latency_s", "step_floor_s", "token_overhead_s", "train_overhead_s",
                     "sync_overhead_s", "network_hop_s"):  # fmt: skip
            number(f"Efficiency.{name}", getattr(self, name), 0, 3600)
        number("Efficiency.train_half_tokens", self.train_half_tokens, 0, 1e12)
        number("Efficiency.max_batch", self.max_batch, 1, 2**20, integer=True)


@dataclass(frozen=True)
class Gpu:
    """One GPU type. Rates are per GPU; GB/s and TFLOP/s are decimal (1e9, 1e12)."""

    name: str
    memory_gib: float
    bf16_tflops: float
    """Dense bf16 tensor-core peak (no sparsity)."""
    hbm_tbps: float
    nvlink_gbps: float
    """NVLink bandwidth per GPU, one direction."""
    network_gbps: float
    """Inter-node bandwidth per GPU (InfiniBand / RoCE), one direction."""
    per_node: int = 8
    efficiency: Efficiency = Efficiency()

    def __post_init__(self) -> None:
        """Raises UserError naming a size or rate that is not a positive number of at most 1e9,
        or a node of no GPUs."""
        for name in ("memory_gib", "bf16_tflops", "hbm_tbps", "nvlink_gbps", "network_gbps"):
            # at most 1e9 (GiB, TFLOP/s, TB/s, GB/s): calibrate's CPU rates stand for "free"
            number(f"Gpu {self.name}: {name}", getattr(self, name), 0, 1e9, above=True)
        number(f"Gpu {self.name}: per_node", self.per_node, 1, 1024, integer=True)

    @property
    def memory_bytes(self) -> float:
        """Memory in bytes."""
        return self.memory_gib * GIB


GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("h100", 79.6, 989.0, 3.35, 450.0, 50.0),
        Gpu("h100-95g", 94.5, 989.0, 3.9, 450.0, 50.0),  # torchtitan's H100 (95 GiB HBM)
        Gpu("h800", 79.6, 989.0, 3.35, 200.0, 50.0),  # China variant: NVLink 400 GB/s bidir
        Gpu("h20", 95.0, 148.0, 4.0, 450.0, 50.0),  # China variant: 96 GB, 148 TFLOP/s
        Gpu("h200", 139.8, 989.0, 4.8, 450.0, 50.0),
        Gpu("a100", 79.2, 312.0, 2.04, 300.0, 25.0),
    )
}
"""GPU types by name. 79.6 GiB is what an 80 GB H100 reports to torch."""


def gpu(name: str, **efficiency: float) -> Gpu:
    """The GPU type ``name``, with efficiencies overridden by keyword.

    Raises:
        UserError: an unknown name (lists the known ones) or an unknown efficiency field.
    """
    if name not in GPUS:
        raise UserError(f"--gpu {name}: unknown GPU type; known: {', '.join(GPUS)}")
    base = GPUS[name]
    unknown = set(efficiency) - set(Efficiency.__dataclass_fields__)
    if unknown:
        raise UserError(f"unknown efficiency field {sorted(unknown)[0]!r}")
    return replace(base, efficiency=replace(base.efficiency, **efficiency))
