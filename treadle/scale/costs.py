"""What one RL step is made of, and what each piece costs in seconds.

The inputs of :mod:`treadle.scale.simulate`: a :class:`Workload` (prompts, samples, response
lengths) on a :class:`Setup` (GPUs, placement, mode), and the closed-form costs the event loop
adds up: a decode step is ``max(FLOPs / (peak x mfu), bytes / (HBM x efficiency), floor) +
layers x layer latency`` (weights plus the batch's KV cache read once per step: the roofline of
Williams et al. 2009 applied to decoding, as in Pope et al. 2022, arXiv 2211.05102, Sec. 3),
plus the engine's tensor-parallel all-reduces (:func:`tp_allreduce`);
training costs its FLOPs (6N per token for forward and backward plus 2N per extra forward,
Kaplan et al. 2020, arXiv 2001.08361, Eq. 2.1, and the causal attention term) at the GPU type's
MFU; a weight sync costs a fixed pause plus bytes over the method's bandwidth.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from dataclasses import dataclass
from typing import Literal

from treadle.scale import memory
from treadle.scale.hardware import Gpu
from treadle.scale.memory import OVERHEAD_BYTES, Recompute, kv_bytes_per_token
from treadle.scale.shapes import ModelShape

Mode = Literal["sync", "one_step", "async"]
SyncMethod = Literal["colocated", "broadcast", "resharded", "gathered"]
SYNC_METHODS: tuple[SyncMethod, ...] = ("colocated", "broadcast", "resharded", "gathered")


@dataclass(frozen=True)
class Lengths:
    """Response lengths (tokens): lognormal with this mean before the cap and shape
    ``sigma`` (long-tailed), capped at ``max``, drawn independently; or ``measured`` lengths
    (e.g. a run's buffer), one prompt's samples at a time."""

    mean: float
    max: int
    sigma: float = 0.8
    measured: tuple[tuple[int, ...], ...] = ()
    """Measured response lengths, one tuple per prompt: a prompt's samples are alike in
    length (in treadle's chain-sum runs 98% of the lengths' variance lies between prompts),
    which decides when a group completes and how stale it is when trained."""

    def __post_init__(self) -> None:
        """Raises ValueError for a measured prompt with no lengths, which no group can draw
        from (the ranges of mean, max and sigma are the checks' of
        :mod:`treadle.scale.checks`, which name the options)."""
        empty = next((k for k, group in enumerate(self.measured) if not group), None)
        if empty is not None:
            raise ValueError(
                f"Lengths(measured=...): prompt {empty} has no lengths; leave out prompts "
                "with no response"
            )

    def capped_mean(self) -> float:
        """The mean response length drawn, tokens, within [1, ``max``]: the measured lengths'
        (each clipped), or the lognormal's E[min(X, M)] = m Phi((ln M - mu - s^2) / s)
        + M (1 - Phi((ln M - mu) / s)), mu = ln m - s^2 / 2 (the limited expected value of a
        lognormal; Klugman, Panjer and Willmot, "Loss Models", Appendix A.4.1.1), plus
        E[(1 - X)+] = Phi(-mu / s) - m Phi((-mu - s^2) / s) for the floor at 1 token (the
        draw's rounding to whole tokens left out); ``mean`` itself is the mean before both."""
        if self.measured:
            lengths = [min(self.max, max(1, n)) for group in self.measured for n in group]
            return sum(lengths) / len(lengths)
        if self.sigma == 0:
            return float(min(max(self.mean, 1), self.max))
        phi = statistics.NormalDist().cdf
        m, s, cap = self.mean, self.sigma, math.log(self.max)
        mu = math.log(m) - s * s / 2
        below_cap = m * phi((cap - mu - s * s) / s) + self.max * (1 - phi((cap - mu) / s))
        return below_cap + phi(-mu / s) - m * phi((-mu - s * s) / s)

    def draw(self, rng: random.Random, groups: int, size: int, extra: int = 0) -> list[int]:
        """``groups`` x (``size`` + ``extra``) lengths, each in [1, max], one group's after
        another: a measured prompt's own lengths (drawn with replacement from them where it
        holds other than ``size``), then ``extra`` more drawn from the same prompt's (ReMax's
        greedy response); or independent lognormal lengths."""
        if not self.measured:
            mu = math.log(self.mean) - self.sigma**2 / 2
            drawn = [min(self.max, max(1, round(rng.lognormvariate(mu, self.sigma))))
                     for _ in range(groups * size)]  # fmt: skip
            if not extra:
                return drawn
            more = [min(self.max, max(1, round(rng.lognormvariate(mu, self.sigma))))
                    for _ in range(groups * extra)]  # fmt: skip
            out = []
            for k in range(groups):
                out += drawn[k * size : (k + 1) * size] + more[k * extra : (k + 1) * extra]
            return out
        out = []
        for _ in range(groups):
            group = rng.choice(self.measured)
            picked = group if len(group) == size else [rng.choice(group) for _ in range(size)]
            picked = [*picked, *(rng.choice(group) for _ in range(extra))]
            out += [min(self.max, max(1, n)) for n in picked]
        return out


@dataclass(frozen=True)
class Workload:
    """One RL step's work."""

    prompts: int
    samples_per_prompt: int
    prompt_tokens: int
    lengths: Lengths
    reward_s: float = 0.0
    """Seconds to score one sample (graders run beside the engines, not on the GPUs)."""
    extra_forwards: int = 1
    """Forward passes besides the update's, each at the policy's cost: 1 for the old policy's
    logprobs, +1 for a reference, +1 for a critic's values, +1 for a reward model's scores."""
    minibatches: int = 1
    """Optimizer steps per RL step (ppo_mini_batch_size = batch / minibatches)."""
    pack_tokens: int = 0
    """Tokens per micro-batch where sequences are packed (NeMo-RL's sequence packing,
    ``train_mb_tokens``; verl's dynamic batch size): a data-parallel rank's share of an
    optimizer step makes ``tokens / pack_tokens`` micro-batches, not one a sample (the pipeline
    bubble of :func:`train_s`); 0: one sample a micro-batch."""
    critic: bool = False
    """A critic of the policy's shape is trained beside it (PPO's value model, verl's critic
    worker): its update adds :func:`train_flops`' update passes without the vocabulary head."""
    lora_rank: int = 0
    """LoRA adapters of this rank train the policy (Hu et al. 2021, arXiv 2106.09685); 0: every
    weight. Its frozen weights need no weight gradients: the update's backward computes the
    input gradients alone, a forward's FLOPs for the linear layers, not two
    (:func:`train_flops`); a KL reference is the policy with its adapters disabled, which
    holds no memory (treadle's, TRL's with PEFT) but runs its forward."""
    greedy_baseline: bool = False
    """ReMax (Li et al. 2023, arXiv 2310.10505, Algorithm 1): each prompt also gets one greedy
    response, whose reward is its samples' baseline, generated once the batch's samples are
    done (treadle's loop and verl's ReMax generate them in a second pass, with the batch's
    policy: synchronous steps only), scored with them, not trained; its length drawn as
    theirs, from the same prompt's where lengths are measured."""
    reward_shape: ModelShape | None = None
    """The reward model's shape, where it is not the policy's: one of ``extra_forwards`` is
    its forward, at its own FLOPs (a sequence classifier: no vocabulary head); None: every
    extra forward at the policy's."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """What a weight sync sends with ``lora_rank``: ``merged`` bf16 weights (``W + (alpha / r)
    B A``, treadle's default ``model.lora.sync``), or the ``adapter`` tensors alone, fp32 as
    trained, which vLLM serves over the base weights it keeps (:func:`sync_s`)."""
    recompute: Recompute = "selective"
    """Activation checkpointing of the trained models (Korthikanti et al. 2022, arXiv
    2205.05198): ``full`` recomputes each layer's forward in the backward pass, one more
    forward an update, about a third more time (their Table 4; verl's
    ``enable_gradient_checkpointing``, NeMo-RL's ``activation_checkpointing``, AReaL's
    ``gradient_checkpointing``); ``selective`` recomputes attention's core only (Sec. 4.2: a
    few percent in Table 4, and nothing more where flash attention recomputes it anyway) and
    ``none`` nothing: both counted as the update's forward and backward alone."""

    @property
    def batch(self) -> int:
        """Samples per step: prompts x samples_per_prompt."""
        return self.prompts * self.samples_per_prompt


@dataclass(frozen=True)
class Setup:
    """GPUs and how the roles use them."""

    gpu: Gpu
    rollout_gpus: int
    train_gpus: int
    colocated: bool = False
    """Engines and trainer on the same GPUs, taking turns (rollout_gpus == train_gpus)."""
    engine_tp: int = 1
    train_tp: int = 1
    train_pp: int = 1
    train_sp: int = 1
    """The trainer's tensor-, pipeline- and Ulysses sequence-parallel degrees: its
    data-parallel ranks are ``train_gpus / (train_tp x train_pp x train_sp)``, pipeline stages
    add the 1F1B schedule's bubble, sequence parallelism its all-to-alls and tensor parallelism
    its all-reduces (:func:`train_s`)."""
    train_ep: int = 0
    """The trainer's expert-parallel degree over its data-parallel ranks (Megatron's
    expert_model_parallel_size): a token's hidden state goes to the ranks of its experts, inside
    its node or across it (:func:`expert_alltoall_s`), and below ZeRO stage 3 each rank keeps
    ``experts / train_ep`` experts' weights and gradients (:func:`memory.trainer`; at stage 3
    every state is sharded over all the data-parallel ranks whatever the degree); 0: the most
    that divides both the ranks and the experts (:meth:`ModelShape.expert_parallel`)."""
    mode: Mode = "sync"
    staleness: float = 0.0
    """eta for ``async``: batches the engines may run ahead of the trainer (AReaL's eta;
    a fraction such as verl's staleness_threshold=0.5 lets half a batch run ahead)."""
    partial: bool = False
    oversample: float = 0.0
    """Extra prompts per batch (0.25: 25% more, rounded up); a batch ends with its first
    ``prompts`` complete groups and the rest are dropped."""
    sync_method: SyncMethod | None = None
    """How the engines get new weights (:func:`sync_s`). Default: ``colocated`` for a
    colocated setup, else ``broadcast``; ``colocated`` needs a colocated setup."""
    updates_per_sync: int = 1
    """Trainer updates per weight sync: the trainer takes ``prompts / updates_per_sync``
    complete groups at a time, in the order they complete, and updates the engines after
    every ``updates_per_sync`` such updates (a step is one sync; verl's fully-async
    ``trigger_parameter_sync_step`` with ``require_batches`` x ``ppo_mini_batch_size``
    prompts an update). Not colocated: a colocated trainer waits for the whole batch."""
    drop_stale: bool = False
    """Drop a group holding a token older than ``ceil(eta)`` versions, when it would be
    trained or as soon as the trainer's version moves past it (treadle's rule,
    :mod:`treadle.rollout.scheduler`). Without it the bound holds at admission only (AReaL's
    rule, Sec. 5.1): a slow group overtaken by later ones may then train ``ceil(eta) + 1``
    versions old."""
    offload: bool = False
    """Colocated: the trainer's resident states go to host memory while the engines generate
    and come back for the update (verl's param_offload and optimizer_offload, NeMo-RL's
    colocated default), so the engine has the GPUs to itself and each step moves the states
    both ways over PCIe (:func:`offload_s`)."""
    offload_bytes: float | None = None
    """Bytes a GPU moves each way when offloading, where the caller has every role's memory
    (``treadle plan``'s and ``treadle simulate``'s placement: the resident states of all the
    trained and forward-only roles, a critic and a reward model among them); None: the
    policy's and a reference's, as :func:`offload_s` sizes them."""
    sync_seconds: float | None = None
    """Seconds of one weight update as measured on the framework, in place of
    :func:`sync_s`'s model of its bytes (a refit's own software costs: NeMo-RL measured 47.2 s
    for DeepSeek-V3, where its bytes take 3.3 s at full bandwidth); None: the model's."""
    spec_tokens: int = 0
    """Draft tokens a decode step proposes per request (speculative decoding with a draft of
    one layer and the output head: DeepSeek-V3's MTP module, an EAGLE head); 0: none."""
    spec_accept: float = 0.0
    """Chance that each draft token is accepted, independently of the others."""

    @property
    def eta(self) -> float:
        """The staleness bound the mode implies."""
        return {"sync": 0, "one_step": 1}.get(self.mode, self.staleness)

    @property
    def tokens_per_step(self) -> float:
        """Tokens a decode step adds to a request on average: ``(1 - a^(k + 1)) / (1 - a)``
        for ``k`` draft tokens each accepted with chance ``a`` (Leviathan et al. 2023,
        arXiv 2211.17192, Eq. 1); 1 without speculative decoding."""
        k, a = self.spec_tokens, self.spec_accept
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def decode_rate(shape: ModelShape, gpu: Gpu, tp: int,
                spec_tokens: int = 0) -> tuple[float, float, float, float]:  # fmt: skip
    """A decode step's cost terms for one engine of ``tp`` GPUs: (seconds per request of
    batch from FLOPs and the per-token overhead, seconds per context token from FLOPs, seconds
    per context token from KV bytes, fixed seconds from the layer latency). A step with
    ``spec_tokens`` draft tokens verifies ``1 + spec_tokens`` tokens a request, each attending
    over the request's context. Weight bytes are :func:`weight_read_s`; the step floor is
    ``efficiency.step_floor_s``."""
    e = gpu.efficiency
    flops = tp * gpu.bf16_tflops * 1e12 * e.decode_mfu
    bandwidth = tp * gpu.hbm_tbps * 1e12 * e.decode_bandwidth
    per_token = (1 + spec_tokens) * (2.0 * shape.active_params() / flops + e.token_overhead_s)
    # each of a request's 1 + spec_tokens verified tokens attends over its context
    per_context_flops = (1 + spec_tokens) * shape.attention_flops_per_token(1.0) / flops
    # each GPU reads its own share of the KV cache: all of MLA's latent, which TP does not
    # split, and at least one whole KV head
    split = 1 if shape.mla else min(tp, shape.kv_heads)  # GPUs a token's KV is split over
    per_context_bytes = kv_bytes_per_token(shape, 1) * (tp / split) / bandwidth
    return per_token, per_context_flops, per_context_bytes, shape.layers * e.layer_latency_s


def ring_gbps(gpu: Gpu, gpus: int) -> float:
    """GB/s a ring collective (broadcast, all-gather, all-reduce) moves through each of ``gpus``
    GPUs at full efficiency: NVLink within a node; spanning nodes, NCCL runs a ring channel
    over each of a node's NICs, so the rings cross between nodes on all of them at once:
    min(NVLink, GPUs a node x network per GPU), 400 GB/s on H100 nodes (NVIDIA's own speed of
    light for NeMo-RL's DeepSeek-V3 refit, 3.3 s for 1.34 TB, is this rate). The GPUs fill
    whole nodes first, and a last node partly filled has only its own GPUs' NICs, which set
    the pace of every ring through it (28 H100s: 4 x 50 = 200 GB/s)."""
    if gpus <= gpu.per_node:
        return gpu.nvlink_gbps
    last = gpus % gpu.per_node or gpu.per_node
    return min(gpu.nvlink_gbps, last * gpu.network_gbps)


def tp_allreduce(shape: ModelShape, gpu: Gpu, tp: int) -> tuple[float, float]:
    """A forward pass's tensor-parallel all-reduces on an engine of ``tp`` GPUs: (fixed
    seconds, seconds per token). Two a layer, of each token's hidden state in bf16 (after
    attention and after the MLP or MoE: Shoeybi et al. 2019, arXiv 1909.08053, Sec. 3); a ring
    all-reduce sends and receives 2 (tp - 1) / tp of the bytes (Patarasuk and Yuan 2009) at
    :func:`ring_gbps`, not overlapped with the kernels. An engine spanning ``n`` nodes adds
    2 floor(log2 n) network hops to each (NCCL's tree latency, ``log2i(nNodes)`` in its
    ``src/graph/tuning.cc``), ``network_hop_s`` each; the latency within a node is
    ``layer_latency_s``'s. (0, 0) for tp 1."""
    if tp == 1:
        return 0.0, 0.0
    e = gpu.efficiency
    calls = 2 * shape.layers
    rate = ring_gbps(gpu, tp) * 1e9 * e.interconnect
    per_token = calls * 2.0 * (tp - 1) / tp * 2.0 * shape.hidden / rate
    nodes = math.ceil(tp / gpu.per_node)
    return calls * 2 * (nodes.bit_length() - 1) * e.network_hop_s, per_token


def draft_fraction(shape: ModelShape) -> float:
    """What one draft token costs, as a fraction of a decode step of the model: a draft of one
    layer and the output head (DeepSeek-V3's MTP module, an EAGLE head), by active parameters:
    ((active - head) / layers + head) / active, head = vocab x hidden."""
    head = shape.vocab * shape.hidden
    active = shape.active_params()
    return ((active - head) / shape.layers + head) / active


def weight_read_s(shape: ModelShape, gpu: Gpu, tp: int, batch: int) -> float:
    """Seconds to read the weights one decode step of ``batch`` requests touches: all dense
    weights, and of each MoE layer the experts its tokens route to (1 - (1 - k/E)^batch)."""
    bandwidth = tp * gpu.hbm_tbps * 1e12 * gpu.efficiency.decode_bandwidth
    expert = shape.expert_params()
    touched = 1 - (1 - shape.experts_active / shape.experts) ** batch if shape.experts else 0
    return 2.0 * (shape.params() - expert + expert * touched) / bandwidth


def segment_s(costs: tuple[float, float, float, float], weights_s: float, b: int, c0: float,
              n: int, floor_s: float = 0.0, growth: float | None = None) -> float:  # fmt: skip
    """Seconds for ``n`` decode steps of a batch of ``b`` whose total context starts at ``c0``
    tokens and grows by ``growth`` (default ``b``) per step: the sum of max(compute, memory,
    floor) + latency, compute and memory linear in the context, summed in closed form between
    the steps where the dominant term changes."""
    per_token, ctx_flops, ctx_bytes, latency = costs
    g = b if growth is None else growth
    # each term as a + k * j over steps j = 0..n-1 (the context is c0 + g * j)
    lines = [(per_token * b + ctx_flops * c0, ctx_flops * g),  # compute
             (weights_s + ctx_bytes * c0, ctx_bytes * g),  # memory
             (floor_s, 0.0)]  # fmt: skip
    cuts = {0, n}
    for i, (a1, k1) in enumerate(lines):
        for a2, k2 in lines[i + 1 :]:
            if k1 != k2 and 0 < (a2 - a1) / (k1 - k2) < n:
                cuts.add(math.ceil((a2 - a1) / (k1 - k2)))
    total = n * latency
    bounds = sorted(cuts)
    for j0, j1 in itertools.pairwise(bounds):
        mid = (j0 + j1 - 1) / 2  # a line dominating at the middle step dominates all of j0..j1-1
        a, k = max(lines, key=lambda line: line[0] + line[1] * mid)
        total += (j1 - j0) * (a + k * mid)
    return total


def update_passes(work: Workload) -> int:
    """Forward passes' worth of FLOPs in an update: its forward and backward (1 + 2), and with
    ``work.recompute`` full the forward recomputed in the backward (Korthikanti et al. 2022,
    arXiv 2205.05198, Sec. 5: 4 in all)."""
    return 3 + (work.recompute == "full")


def forward_flops(shape: ModelShape, tokens: int) -> float:
    """FLOPs of one forward pass over a sequence of ``tokens``: 2N a token (Kaplan et al. 2020,
    arXiv 2001.08361, Eq. 2.1, N the active parameters) plus causal attention, each token
    attending over ``tokens / 2`` on average."""
    attention = shape.attention_flops_per_token(tokens / 2) * tokens
    return 2.0 * shape.active_params() * tokens + attention


def train_flops(shape: ModelShape, work: Workload, lengths: list[int]) -> float:
    """FLOPs of training on one batch of responses of ``lengths`` tokens: forward FLOPs (2N
    per token plus causal attention, 2 L q s^2 per sequence) times :func:`update_passes` (3,
    or 4 recomputing each layer) for the update and once per extra forward; with
    ``work.critic`` as many update passes of the critic's, the forward without its
    2 x vocab x hidden FLOPs a token of vocabulary head (a value head has one output). With
    ``work.lora_rank`` the policy's frozen linear layers skip their weight gradients: one pass
    fewer of the 2N part (the attention scores' backward stays), and the adapters add their
    own, 2 x :meth:`~treadle.scale.shapes.ModelShape.lora_params` a token, in the update's
    passes (forward, input and weight gradients; the extra forwards count the base model's
    alone: a reference runs with the adapters disabled). With ``work.reward_shape`` one extra
    forward is that model's, without its vocabulary head."""
    fwd = head = tokens = 0.0
    for response in lengths:
        s = work.prompt_tokens + response
        tokens += s
        fwd += forward_flops(shape, s)
        head += 2.0 * shape.vocab * shape.hidden * s
    update = update_passes(work)
    policy = fwd * (update + work.extra_forwards)
    if work.reward_shape is not None:  # that forward at the reward model's cost instead
        rm = work.reward_shape
        scored = sum(forward_flops(rm, work.prompt_tokens + n) for n in lengths)
        policy += scored - 2.0 * rm.vocab * rm.hidden * tokens - fwd
    if work.lora_rank:
        adapters = 2.0 * shape.lora_params(work.lora_rank) * tokens
        policy += update * adapters - 2.0 * shape.active_params() * tokens
    return policy + (update * (fwd - head) if work.critic else 0.0)


def train_s(shape: ModelShape, gpu: Gpu, gpus: int, work: Workload, lengths: list[int],
            tp: int = 1, pp: int = 1, sp: int = 1, ep: int = 0) -> float:  # fmt: skip
    """Seconds to train on one batch: :func:`train_flops` on ``gpus`` GPUs at the MFU that the
    tokens per GPU and optimizer step reach, stretched by the pipeline bubble of ``pp`` stages,
    plus :func:`ulysses_s` for ``sp`` > 1, :func:`train_tp_s` for ``tp`` > 1,
    :func:`expert_alltoall_s` for a mixture of experts (over ``ep`` expert-parallel ranks; 0:
    the most that divide) and the fixed ``train_overhead_s``.

    The bubble: each of the ``gpus / (tp x pp x sp)`` data-parallel ranks pushes its share of
    an optimizer step's samples through the stages one sample a micro-batch, or packed into
    micro-batches of ``work.pack_tokens`` tokens (m of them, whole: the busiest rank's), and
    the 1F1B schedule takes (m + pp - 1) / m of the time without stages (Narayanan et al.
    2021, arXiv 2104.04473, Sec. 2.2: bubble fraction (pp - 1) / m). Data-parallel ranks
    beyond an optimizer step's micro-batches hold none and idle: the work is spread over the
    ranks that hold one."""
    e = gpu.efficiency
    tokens = sum(lengths) + len(lengths) * work.prompt_tokens  # every sample's prompt too
    replica = tp * pp * sp
    # whole micro-batches an optimizer step: bins of packed sequences, or samples
    units = (tokens / work.pack_tokens if work.pack_tokens else len(lengths)) / work.minibatches
    ranks = min(max(1, gpus // replica), max(1, math.ceil(units)))  # those holding work
    busy = min(gpus, ranks * replica)
    tokens_per_gpu = tokens / (busy * work.minibatches)
    mfu = e.train_mfu * tokens_per_gpu / (tokens_per_gpu + e.train_half_tokens)
    flops = train_flops(shape, work, lengths)
    micro = max(1, math.ceil(units / ranks))  # the busiest rank's micro-batches set the pace
    bubble = (micro + pp - 1) / micro
    compute = flops / (busy * gpu.bf16_tflops * 1e12 * mfu) * bubble
    # the collectives of the ranks at work (the experts spread over them where no ep is given)
    comms = (ulysses_s(shape, gpu, busy, work, tokens, tp, sp)
             + train_tp_s(shape, gpu, busy, work, tokens, tp)
             + expert_alltoall_s(shape, gpu, busy, work, tokens, replica,
                                 tp * sp, ep))  # fmt: skip
    return compute + comms + e.train_overhead_s


def train_tp_s(shape: ModelShape, gpu: Gpu, gpus: int, work: Workload, tokens: float,
               tp: int) -> float:  # fmt: skip
    """Seconds of a trainer's tensor-parallel all-reduces for training on ``tokens`` tokens
    (Megatron's layout, Shoeybi et al. 2019, arXiv 1909.08053, Sec. 3: two all-reduces a layer
    in the forward pass and two in the backward; sequence parallelism's all-gather and
    reduce-scatter move the same bytes): :func:`tp_allreduce`'s bytes a token, on the
    ``tokens x tp / gpus`` tokens each tensor-parallel group holds, for the passes of
    :func:`collective_passes`. Not overlapped with compute;
    the network hops' latency, small against these messages, left out. 0 for tp 1."""
    if tp == 1:
        return 0.0
    return collective_passes(work) * tokens * tp / gpus * tp_allreduce(shape, gpu, tp)[1]


def collective_passes(work: Workload) -> int:
    """Passes whose layers run a trainer's per-layer collectives in a step: the update's
    forward and backward (and its recomputed forward, ``work.recompute`` full), each extra
    forward, and a critic's update as many."""
    update = 2 + (work.recompute == "full")
    return update + work.extra_forwards + (update if work.critic else 0)


def expert_alltoall_s(shape: ModelShape, gpu: Gpu, gpus: int, work: Workload, tokens: float,
                      replica: int, node_group: int, ep: int = 0) -> float:  # fmt: skip
    """Seconds of a trainer's expert-parallel all-to-alls for training on ``tokens`` tokens
    (Lepikhin et al. 2020, GShard, arXiv 2006.16668, Sec. 2.2; Megatron's all-to-all token
    dispatcher): the experts sharded over ``ep`` of the ``gpus / replica`` data-parallel ranks
    (0: the most that divide, :meth:`~treadle.scale.shapes.ModelShape.expert_parallel`, as
    :func:`~treadle.scale.memory.trainer_layout` shards them), each token's bf16 hidden state
    goes to each of its ``experts_active`` experts and comes back, ``2 x 2 x k x hidden``
    bytes a token and MoE layer, of which (ep - 1) / ep leave its GPU. A GPU holds
    ``tokens x moe_layers / gpus`` token-layers whatever the tensor, pipeline and sequence
    split; the share bound for other nodes (a node holds ``per_node / node_group`` expert
    ranks, ``node_group`` = tp x sp) crosses its own NIC, the rest NVLink, the slower of the
    two setting the time; for the passes of :func:`collective_passes`. Not overlapped with
    compute. 0 for a dense model or one data-parallel rank."""
    ep = ep or shape.expert_parallel(gpus // replica)
    if ep <= 1:
        return 0.0
    local = min(ep, max(1, gpu.per_node // node_group))  # expert ranks on a GPU's node
    per_gpu = tokens * shape.moe_layers / gpus * 4.0 * shape.experts_active * shape.hidden
    cross = per_gpu * (ep - local) / ep / gpu.network_gbps
    within = per_gpu * (local - 1) / ep / gpu.nvlink_gbps
    return collective_passes(work) * max(cross, within) / (1e9 * gpu.efficiency.interconnect)


def ulysses_s(shape: ModelShape, gpu: Gpu, gpus: int, work: Workload, tokens: float, tp: int,
              sp: int) -> float:  # fmt: skip
    """Seconds of DeepSpeed-Ulysses' all-to-alls for training on ``tokens`` tokens (Jacobs et
    al. 2023, arXiv 2309.14509, Sec. 3.1): per layer and pass, each GPU sends (sp - 1) / sp of
    its tokens' queries, keys and values (bf16, its tensor-parallel share) and receives as much
    attention output, ``2 (2 q + 2 kv) / tp`` bytes a token, over NVLink (the network where
    tp x sp spans nodes); for the passes of :func:`collective_passes`. Not overlapped with
    compute."""
    if sp == 1:
        return 0.0
    per_gpu = tokens * tp / gpus  # a tensor-parallel group holds the same tokens
    per_token = 2.0 * (2 * shape.q_dim + 2 * shape.kv_dim) / tp * shape.layers * (sp - 1) / sp
    link = gpu.nvlink_gbps if tp * sp <= gpu.per_node else gpu.network_gbps
    rate = link * 1e9 * gpu.efficiency.interconnect
    return collective_passes(work) * per_gpu * per_token / rate


def sync_s(shape: ModelShape, setup: Setup, adapter_rank: int = 0) -> float:
    """Seconds of one weight update of the engines, bf16 weights (or, with ``adapter_rank``,
    the fp32 LoRA adapters of that rank alone, ``4 x ModelShape.lora_params`` bytes: treadle's
    ``model.lora.sync=adapter``; a colocated engine still wakes its base weights): a fixed
    pause, plus
    ``colocated``: each GPU's shard copied in place and the engine's weights woken from host
    memory (PCIe); ``broadcast``: the whole model from one trainer GPU to every engine GPU by
    a pipelined ring broadcast (:func:`ring_gbps` over the GPUs it spans); ``resharded``: each
    trainer GPU sends its shard over its own NVLink, or across nodes its share of a full
    node's NICs, ``per_node x network / senders a node``, at most NVLink (NCCL's PXN routes a
    GPU's sends through the node's other NICs; so never slower than ``broadcast``, whose rings
    a partly filled node paces); ``gathered``: every tensor is gathered whole on every trainer
    GPU before its engine takes its shard, so each GPU receives the whole model by rings:
    NeMo-RL's colocated refit from Megatron, whose Megatron-Bridge export broadcasts each layer
    over the pipeline stages and all-gathers its tensor- and expert-parallel pieces on every
    rank. ``setup.sync_seconds``, where given, replaces all of it (a refit measured on the
    framework)."""
    if setup.sync_seconds is not None:
        return setup.sync_seconds
    g, e = setup.gpu, setup.gpu.efficiency
    base = 2.0 * shape.params()
    weights = 4.0 * shape.lora_params(adapter_rank) if adapter_rank else base
    method = setup.sync_method or ("colocated" if setup.colocated else "broadcast")
    if method == "colocated":  # the engine's base weights woken, what changed copied in place
        wake, copy = base / setup.engine_tp, weights / setup.engine_tp
        return e.sync_overhead_s + wake / (e.pcie_gbps * 1e9) + copy / (g.hbm_tbps * 1e12)
    # the GPUs the weights cross: a colocated setup's are the trainer's own
    spanned = setup.train_gpus + (0 if setup.colocated else setup.rollout_gpus)
    if method in ("gathered", "broadcast"):  # every GPU receives the whole model by rings
        return e.sync_overhead_s + weights / (ring_gbps(g, spanned) * 1e9 * e.interconnect)
    senders = min(setup.train_gpus, setup.rollout_gpus)
    if spanned <= g.per_node:
        gbps = senders * g.nvlink_gbps
    else:  # a node's NICs shared by its senders, each on all of them (NCCL's PXN)
        nics = g.per_node * g.network_gbps
        gbps = senders * min(g.nvlink_gbps, nics / min(senders, g.per_node))
    return e.sync_overhead_s + weights / (gbps * 1e9 * e.interconnect)


def offload_s(shape: ModelShape, setup: Setup, lora_rank: int = 0) -> float:
    """Seconds a step spends moving a colocated trainer's resident states to host memory and
    back (``setup.offload``; 0 without): the policy's parameter shards, gradients and
    optimizer states and the reference's bf16 shards, per GPU, twice over PCIe; with LoRA
    adapters of ``lora_rank``, the frozen bf16 shards and the adapters' states (the reference
    is the same weights); ``setup.offload_bytes`` each way, where given."""
    if not setup.offload:
        return 0.0
    if setup.offload_bytes is not None:
        return 2 * setup.offload_bytes / (setup.gpu.efficiency.pcie_gbps * 1e9)
    layout = memory.trainer_layout(shape, setup.train_gpus, setup.train_tp, setup.train_pp,
                                   setup.train_sp, ep=setup.train_ep)  # fmt: skip
    # resident states do not depend on the sequences a pass holds: one token of one
    policy = memory.trainer(shape, layout, 1, 1, lora_rank=lora_rank).resident
    reference = 0.0 if lora_rank else memory.trainer(shape, layout, 1, 1, role="reference",
                                                     trainable=False).resident  # fmt: skip
    return 2 * (policy + reference) / (setup.gpu.efficiency.pcie_gbps * 1e9)


def kv_capacity(shape: ModelShape, setup: Setup) -> float:
    """Tokens one engine's KV cache holds: its GPUs' memory left by :func:`memory.engine`
    (may be negative where the weights alone do not fit)."""
    tp = setup.engine_tp
    left = memory.engine(shape, setup.gpu, tp).kv_cache
    if left == 0.0:  # engine() clamps at 0: say how far short the weights are
        left = setup.gpu.memory_bytes * setup.gpu.efficiency.kv_memory_fraction
        left -= OVERHEAD_BYTES + 2.0 * shape.params() / tp
    return left / kv_bytes_per_token(shape, tp)  # each GPU holds its share of every token
