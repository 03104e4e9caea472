"""Memory per GPU of each role: parameters, gradients, optimizer states, activations, logits,
KV cache and framework overhead, for a data/tensor/pipeline-parallel layout.

Sources: ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054, Sec. 3.1 and 5: 2 + 2 + K bytes per
parameter with K = 12 for mixed-precision Adam, each term divided by the data-parallel degree
from its stage on); activations per layer after Korthikanti et al. 2022 (arXiv 2205.05198,
Eq. 1 to 6), counted for today's layers (RMSNorm, SwiGLU, grouped-query attention, flash
attention, no dropout): for a GPT layer this gives 32 sbh bytes, their 34 sbh less the two
dropout masks, and flash attention keeps none of their 5 a s^2 b score bytes. Sequence
parallelism after DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509, Sec. 3): each of
``sp`` GPUs holds ``seq / sp`` of every sequence's tokens, and all-to-alls hand attention whole
sequences of ``heads / sp`` heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from treadle.core.errors import UserError
from treadle.scale.hardware import GIB, Gpu
from treadle.scale.shapes import ModelShape
from treadle.scale.values import choice, flag, number

Recompute = Literal["none", "selective", "full"]
Convention = Literal["mixed", "fsdp"]
OVERHEAD_BYTES = 1.0 * GIB
"""CUDA context, cuBLAS workspaces and NCCL buffers per process."""
FRAGMENTATION = 0.05
"""What the caching allocator reserves beyond what tensors hold (torch's reserved / allocated)."""


@dataclass(frozen=True)
class Layout:
    """How one role's model is split over GPUs: dp x tp x pp x sp GPUs (ep shards the experts
    over the data-parallel ranks, as Megatron's expert parallelism does)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 3
    """ZeRO stage 0-3 over the dp x sp ranks; 3 is FSDP's full sharding."""
    convention: Convention = "fsdp"
    """``mixed``: bf16 parameters and gradients, fp32 master copy and Adam moments (ZeRO's
    2 + 2 + 12 bytes). ``fsdp``: fp32 sharded parameters, gradients and Adam moments
    (4 + 4 + 8), with bf16 copies of the layers being all-gathered (torchtitan's FSDP2)."""
    sp: int = 1
    """Ulysses sequence-parallel degree (verl's ``ulysses_sequence_parallel_size``): each
    sequence's tokens split over ``sp`` GPUs, which hold the same data and join the ZeRO/FSDP
    sharding group (verl's FSDP mesh spans them)."""

    @property
    def gpus(self) -> int:
        """GPUs of the layout: dp x tp x pp x sp."""
        return self.dp * self.tp * self.pp * self.sp


@dataclass(frozen=True)
class Breakdown:
    """Bytes per GPU of one role, term by term."""

    role: str
    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    kv_cache: float = 0.0
    overhead: float = 0.0
    gathered: float = 0.0
    """Of ``parameters``: the bf16 layers FSDP gathers for the role's own passes, held only
    while they run."""

    @property
    def total(self) -> float:
        """Bytes of all terms."""
        return sum(self.terms().values())

    @property
    def resident(self) -> float:
        """Bytes held between the role's passes: its parameter shards, gradients and optimizer
        states."""
        return self.parameters - self.gathered + self.gradients + self.optimizer

    def terms(self) -> dict[str, float]:
        """Each term by name, in bytes."""
        names = ("parameters", "gradients", "optimizer", "activations", "logits", "kv_cache")
        return {n: getattr(self, n) for n in (*names, "overhead")}


def trainer_layout(shape: ModelShape, gpus: int, tp: int = 1, pp: int = 1, sp: int = 1,
                   zero: int = 3, ep: int = 0) -> Layout:  # fmt: skip
    """A trainer's layout over ``gpus``: tp x pp x sp model- and sequence-parallel, ZeRO
    ``zero`` (FSDP at 3) over the data-parallel rest, a MoE model's experts sharded over ``ep``
    of those ranks (0: the most that divide the ranks and the experts)."""
    dp = max(1, gpus // (tp * pp * sp))
    return Layout(dp=dp, tp=tp, pp=pp, sp=sp, ep=ep or shape.expert_parallel(dp), zero=zero)


def check_layout(shape: ModelShape, layout: Layout, names: Mapping[str, str] | None = None,
                 gpus: int | None = None) -> None:  # fmt: skip
    """Raises UserError for a layout the model cannot take, naming the ones it can (on
    ``gpus``, where given) by the options ``names`` gives for "tp", "sp" and "pp" (default
    ``--tp``, ``--sp``, ``--pp``)."""
    for name in ("dp", "tp", "pp", "sp", "ep"):
        number(f"Layout.{name}", getattr(layout, name), 1, 2**20, integer=True)
    number("Layout.zero", layout.zero, 0, 3, integer=True)
    choice("Layout.convention", layout.convention, get_args(Convention))
    if layout.dp % layout.ep:
        raise UserError(f"expert parallel {layout.ep} does not divide the {layout.dp} "
                        "data-parallel ranks (Megatron shards the experts over them)")  # fmt: skip
    names = {n: f"--{n}" for n in ("tp", "sp", "pp")} | dict(names or {})
    if layout.tp < 1 or shape.heads % layout.tp:
        fits = [t for t in range(1, 129) if shape.heads % t == 0
                and (gpus is None or gpus % t == 0)][-4:]  # fmt: skip
        use = f"use {names['tp']} {' or '.join(map(str, fits))}" if fits else "change --gpus"
        raise UserError(
            f"tensor parallel {layout.tp} does not divide the {shape.heads} attention heads of "
            f"{shape.name}; {use}"
        )
    if layout.sp < 1 or shape.heads % (layout.tp * layout.sp):
        per_tp = shape.heads // layout.tp
        fits = [s for s in range(1, min(per_tp, 32) + 1) if per_tp % s == 0
                and (gpus is None or gpus % (layout.tp * s) == 0)][-4:]  # fmt: skip
        use = (f"use {names['sp']} {' or '.join(map(str, fits))}" if fits else
               f"no {names['sp']} fits {names['tp']} {layout.tp} on {gpus} GPUs: change "
               f"{names['tp']} or --gpus")  # fmt: skip
        raise UserError(
            f"sequence parallel {layout.sp} does not divide the {per_tp} attention heads per "
            f"tensor-parallel rank of {shape.name} (Ulysses hands each GPU whole heads); {use}"
        )
    if layout.pp > shape.layers:
        raise UserError(
            f"pipeline parallel {layout.pp} is more stages than {shape.name}'s {shape.layers} "
            f"layers; use {names['pp']} {shape.layers} or fewer"
        )


def per_token_layer_bytes(shape: ModelShape, recompute: Recompute) -> float:
    """Activation bytes one token keeps per layer for the backward pass (bf16).

    ``none``: attention keeps its norm's input, the QKV input, Q/K/V and the attention output
    (2h + 2h + 2(q + 2kv) + 2q); the MLP its norm's input, its input and for SwiGLU the gate, up,
    activation and product outputs (2h + 2h + 8i; a GPT MLP 2h + 2h + 4i with i = 4h),; flash
    attention keeps none of Korthikanti's 5 a s score bytes. ``selective``: the
    layer input, the attention output and every second matmul output (torchtitan's op-level
    selective checkpointing; norms and activations recomputed). ``full``: the layer input.
    """
    h, q, kv = shape.hidden, shape.q_dim, shape.kv_dim
    i = shape.expert_intermediate * shape.experts_active if shape.experts else shape.intermediate
    if recompute == "full":
        return 2.0 * h
    if recompute == "selective":
        matmul_outputs = q + 2 * kv + h + (2 * i if shape.gated_mlp else i) + h
        return 2.0 * h + 2.0 * q + matmul_outputs  # half of them, 2 bytes each
    mlp = 4 * h + (8 * i if shape.gated_mlp else 4 * i)
    return 4 * h + 2 * (q + 2 * kv) + 2 * q + mlp


def trainer(
    shape: ModelShape,
    layout: Layout,
    micro_batch: int,
    seq: int,
    recompute: Recompute = "selective",
    role: str = "policy",
    trainable: bool = True,
    lora_rank: int = 0,
) -> Breakdown:
    """Bytes per GPU of a trained (policy, critic) or forward-only (reference, reward model)
    role holding ``micro_batch`` sequences of ``seq`` tokens per pass; trained with LoRA
    adapters of ``lora_rank`` (> 0), its frozen weights are held as a forward-only role's and
    only the adapters (:meth:`~treadle.scale.shapes.ModelShape.lora_params`) have fp32
    weights, gradients and Adam moments, sharded like the dense weights; its activations and
    logits are a trained role's (the backward passes every layer to reach the adapters).

    Model states are divided by tp x pp, then per ZeRO stage by dp x sp; each expert's by ep,
    then per ZeRO stage by the dp x sp / ep ranks that hold it (Megatron's expert data
    parallelism). FSDP's gathered bf16 copies: two layers (a layer's own experts only) and the
    output layer, whether tied to the embedding or not.
    The activations of L / pp layers are held for pp micro-batches in flight (1F1B's first
    stage), divided by tp (Megatron's sequence parallel); each GPU holds ``seq / sp`` tokens of
    a sequence (Ulysses), for activations and logits alike. A critic has a value head instead
    of the vocabulary logits. Forward-only roles keep bf16 weights, sharded like the trained
    ones at ZeRO-3 (verl's FSDP reference, OpenRLHF's and TRL's ZeRO-3 one), and one layer's
    activations.
    """
    check_layout(shape, layout)
    number("micro_batch (--micro-batch)", micro_batch, 0, 2**24, above=True)
    number("seq (--prompt-tokens + --max-response)", seq, 1, 2**41)
    number("lora_rank (--lora-rank)", lora_rank, 0, shape.hidden, integer=True)
    choice("recompute (--recompute)", recompute, get_args(Recompute))
    choice("role (--roles)", role, ("policy", "reference", "critic", "reward"))
    flag("trainable", trainable)
    tokens = micro_batch * seq / layout.sp
    vocab = 1 if role in ("critic", "reward") else shape.vocab
    params, grads, optimizer, gathered = model_states(shape, layout, trainable and not lora_rank)
    if trainable and lora_rank:
        adapters = lora_states(shape, layout, lora_rank)
        params, grads, optimizer = params + adapters[0], adapters[1], adapters[2]
    if not trainable:
        activations = 4 * tokens * shape.hidden / layout.tp
        logits = tokens * vocab * (2 + 4) / layout.tp  # bf16 logits, fp32 log-softmax
        return _with_overhead(Breakdown(role, params, 0, 0, activations, logits,
                                        gathered=gathered))  # fmt: skip
    per_layer = per_token_layer_bytes(shape, recompute) * tokens
    activations = per_layer * shape.layers / layout.tp
    if recompute == "full":  # plus one layer recomputed at a time
        activations += per_token_layer_bytes(shape, "none") * tokens / layout.tp
    # bf16 logits, their fp32 copy, cross-entropy's saved log-probabilities, the fp32 gradient
    logits = tokens * vocab * (2 + 4 + 4 + 4) / layout.tp
    return _with_overhead(Breakdown(role, params, grads, optimizer, activations, logits,
                                    gathered=gathered))  # fmt: skip


def model_states(shape: ModelShape, layout: Layout, trainable: bool = True) -> tuple[float, ...]:
    """Bytes per GPU of (parameters, gradients, optimizer states, the gathered layers among
    the parameters) of a trained role, or of a forward-only role's bf16 weights (then
    gradients and optimizer states are 0), in ``layout``; see :func:`trainer` for the
    sharding."""
    model_split = layout.tp * layout.pp
    expert = shape.expert_params()
    dense = (shape.params() - expert) / model_split
    experts = expert / (model_split * layout.ep)
    z, dp = layout.zero, layout.dp * layout.sp
    # ZeRO shards the dense part over every data-parallel rank and each expert over the ranks
    # holding it (Megatron's expert data parallel: dp x sp / ep)
    expert_dp = max(1, dp // layout.ep)

    def states(bytes_per_param: float, stage: int) -> float:
        """Bytes per GPU of one model state, sharded from ZeRO ``stage`` on."""
        sharded = z >= stage
        return bytes_per_param * (dense / (dp if sharded else 1) +
                                  experts / (expert_dp if sharded else 1))  # fmt: skip

    head = shape.vocab * shape.hidden / model_split  # the output layer (tied: the embedding)
    embeddings = shape.vocab * shape.hidden * (1 if shape.tied_embeddings else 2)
    layer = (shape.params() - expert - embeddings) / shape.layers / model_split
    layer += expert / shape.layers / (model_split * layout.ep)  # only its own experts
    # FSDP gathers two layers (one computing, one prefetched) and the output layer in bf16;
    # ZeRO's own accounting (Fig. 1) counts the shards alone
    gathered = 0.0 if layout.convention == "mixed" else 2 * (2 * layer + head)
    if not trainable:  # FSDP gathers a layer at a time; whole bf16 weights unsharded
        if z >= 3 and dp > 1:
            return states(2, 3) + gathered, 0.0, 0.0, gathered
        return 2 * (dense + experts), 0.0, 0.0, 0.0
    if layout.convention == "mixed":
        return states(2, 3), states(2, 2), states(12, 1), 0.0
    gathered = gathered if z >= 3 else 0.0
    return states(4, 3) + gathered, states(4, 2), states(8, 1), gathered


def lora_states(shape: ModelShape, layout: Layout, rank: int) -> tuple[float, float, float]:
    """Bytes per GPU of LoRA adapters' (fp32 weights, gradients, Adam moments): 4 + 4 + 8
    bytes a parameter of :meth:`~treadle.scale.shapes.ModelShape.lora_params`, divided by
    tp x pp and, from each ZeRO stage on, by the dp x sp ranks (no routed expert has
    adapters, so expert parallelism does not split them)."""
    per_gpu = shape.lora_params(rank) / (layout.tp * layout.pp)
    dp = layout.dp * layout.sp

    def sharded(bytes_per_param: float, stage: int) -> float:
        """Bytes per GPU of one adapter state, sharded from ZeRO ``stage`` on."""
        return bytes_per_param * per_gpu / (dp if layout.zero >= stage else 1)

    return sharded(4, 3), sharded(4, 2), sharded(8, 1)


def engine(
    shape: ModelShape, gpu: Gpu, tp: int, ep: int = 1, budget: float | None = None
) -> Breakdown:
    """Bytes per GPU of an inference engine of ``tp`` GPUs (``ep`` shards its experts): bf16
    weights, and a KV cache filling the rest of ``budget`` (default: the GPU's memory times
    ``kv_memory_fraction``, vLLM's gpu_memory_utilization)."""
    check_layout(shape, Layout(tp=tp), {"tp": "--engine-tp"})
    number("engine's ep", ep, 1, max(1, shape.experts), integer=True)
    if budget is not None:
        number("engine's budget (bytes)", budget, -(2**60), 2**60)  # below 0: no KV cache
    expert = shape.expert_params()
    weights = 2 * ((shape.params() - expert) / tp + expert / (tp * ep))
    budget = gpu.memory_bytes * gpu.efficiency.kv_memory_fraction if budget is None else budget
    kv = max(0.0, budget - weights - OVERHEAD_BYTES)
    return Breakdown("engine", parameters=weights, kv_cache=kv, overhead=OVERHEAD_BYTES)


def kv_bytes_per_token(shape: ModelShape, tp: int = 1) -> float:
    """KV cache bytes of one token on one of ``tp`` GPUs (bf16): its share of the KV heads, at
    least one whole head (vLLM replicates them where ``tp`` exceeds them); MLA's latent is not
    split."""
    return 2.0 * shape.kv_elements_per_token() / (1 if shape.mla else min(tp, shape.kv_heads))


def update_phase(roles: list[Breakdown]) -> Breakdown:
    """Bytes per training GPU at the update phase's peak of ``roles`` sharing the GPUs in one
    process (verl's and OpenRLHF's actor and reference workers, treadle's trainer): every
    role's resident states, plus the largest of the roles' passes (gathered layers,
    activations, logits: the reference's forward, the old-logprob forward and the update run
    one after another), plus one process's overhead."""
    if not roles:
        return Breakdown("update")
    peak = max(roles, key=lambda b: b.gathered + b.activations + b.logits)
    resident = sum(b.parameters - b.gathered for b in roles) + peak.gathered
    held = Breakdown("update", resident, sum(b.gradients for b in roles),
                     sum(b.optimizer for b in roles), peak.activations, peak.logits,
                     gathered=peak.gathered)  # fmt: skip
    return _with_overhead(held)


def _with_overhead(b: Breakdown) -> Breakdown:
    held = b.total
    return Breakdown(
        b.role, b.parameters, b.gradients, b.optimizer, b.activations, b.logits, b.kv_cache,
        OVERHEAD_BYTES + FRAGMENTATION * held, b.gathered,
    )  # fmt: skip
