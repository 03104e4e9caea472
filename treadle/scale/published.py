"""The published step times and throughputs the simulator is checked against (SCALE.md's table,
``tests/scale/test_calibration.py``, ``bench/scale_published.py``): each figure with the
setting it was measured in, as the simulator takes it.

Settings the papers and READMEs state are used as stated; the rest are assumptions, each named
in a comment and in SCALE.md. Nothing here is fitted to the figure it is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from treadle.scale.costs import Lengths, Setup, Workload
from treadle.scale.hardware import gpu
from treadle.scale.plan import DEFAULT_ROLES
from treadle.scale.shapes import NAMED
from treadle.scale.simulate import simulate


@dataclass(frozen=True)
class Row:
    """One published figure and its setting."""

    setting: str
    published: float
    unit: Literal["s", "tok/s"]
    """Seconds a step, or trained tokens a second."""
    shape: str
    work: Workload
    setup: Setup
    steps: int | None = None
    """Steps simulated: None, to the steady state (:func:`treadle.scale.simulate.simulate`)."""
    window: tuple[int, int] | None = None
    """The steps the publisher averaged, first..last of ``steps``, where its runs are too short
    for a steady state (NeMo-RL's); None: the steady state."""
    roles: tuple[str, ...] = DEFAULT_ROLES
    """The roles ``treadle simulate``'s memory check holds (DAPO runs no reference)."""

    def predict(self) -> float:
        """The simulator's figure in ``unit``, for this setting (seconds, no device)."""
        r = simulate(NAMED[self.shape], self.work, self.setup, self.steps, window=self.window)
        return r.tokens_per_s if self.unit == "tok/s" else r.step_s


# AReaL (arXiv 2505.24298), R1-Distill-Qwen-1.5B, 8 H800, 8k context, 64 prompts x 16; assumed
# 6 generation : 2 training GPUs, 300-token prompts, responses lognormal mean 5,000, 4
# optimizer steps a batch; each layer recomputed in the backward pass (the paper's system,
# realhf, defaults to gradient_checkpointing=True: ModelTrainEvalConfig in realhf/api/cli_args.py)
AREAL = Workload(64, 16, 300, Lengths(5000, 8192, 0.8), minibatches=4, recompute="full")
# verl fully-async README: Qwen2.5-Math-7B, DAPO, 28K max response, n=16, 512 prompts in 16
# mini-batches; the async scripts' engine TP 4, Ulysses sequence parallel 4, gradient
# checkpointing (enable_gradient_checkpointing=True: each layer recomputed), 4 streamed updates
# of 128 prompts a sync and no old-logprob forward (use_rollout_log_probs); assumed 200-token
# prompts, lognormal responses (mean 1,500, sigma 1.0) and the colocated runs' engine TP 2 and
# Ulysses 4 (verl's one-step-off colocate script: the table's colocated script is not
# published)
VERL_SYNC = Workload(
    512, 16, 200, Lengths(1500, 28672, 1.0), extra_forwards=1, minibatches=16, recompute="full"
)
VERL_ASYNC = Workload(
    512, 16, 200, Lengths(1500, 28672, 1.0), extra_forwards=0, minibatches=16, recompute="full"
)
# NeMo-RL v0.6 performance summary, DeepSeek-V3: GRPO 32 x 16, max sequence 1,536, average
# sequence 697-710 tokens, engines of TP 32, training PP 16 x EP 16; its recipes
# (grpo-deepseek-v3-32n8g.yaml and the 64n8g ones over it): sequence packing into micro-batches
# of train_mb_tokens = 1,536 x train_micro_batch_size 1 tokens, activation_checkpointing (NeMo-RL
# sets Megatron's recompute_granularity full, one layer at a time), and NeMo-RL's default refit (IPC
# colocated, from Megatron-Bridge's export: every rank gathers every tensor whole, sync method
# "gathered"), the trainer's states offloaded to host memory while the colocated engines generate
# (NeMo-RL's colocated mode: offload_before_refit / offload_after_refit); the one-step recipe
# (grpo-deepseek-v3-64n8g-async-1off.yaml): 32 generation nodes and 32 training nodes,
# max_trajectory_age_steps 1, in_flight_weight_updates true, the refit broadcast from the training
# ranks (NCCL, the non-colocated default) as NeMo-RL measured it (NEMO_NCCL_REFIT_S). The v0.6.0
# recipes (tag of 2026-04-29) generate without speculative decoding: MTP (speculative_config
# deepseek_mtp) came into them on 2026-06-24, and v0.6.0's DeepSeek guide sets
# num_nextn_predict_layers to 0. Assumed: 150-token prompts
# (OpenMathInstruct-2 problems in a chat template), responses lognormal with sigma 0.8 and mean
# 600 before the 1,386-token cap (547 after it: 697 in all), a reference and an old-logprob forward
NEMO = Workload(
    32, 16, 150, Lengths(600, 1386, 0.8), extra_forwards=2, pack_tokens=1536, recompute="full"
)
# NeMo-RL's colocated refit of DeepSeek-V3 as NeMo-RL measured it (blog, 2025-08-12, "Journey of
# Optimizing Weight Transfer in Large MoE Models by 10x", Table 1, v0.3: 12.2 s gathering the
# parameters, 33.5 s passing CUDA IPC handles, 1.5 s loading them into vLLM; TP 64 engines from
# EP 64 x PP 8 training), where the bytes alone take 3.3 s at full bandwidth; assumed the same
# in v0.6
NEMO_REFIT_S = 47.2
# NeMo-RL's non-colocated refit of DeepSeek-V3 as NeMo-RL measured it: the NCCL collective update
# path (the non-colocated default, every full tensor broadcast to the generation ranks) from
# Megatron TP1 x PP16 x EP16 to vLLM engines of TP 32 (async engine), 14.21 s on the dedicated
# async refit timer (docs/guides/checkpoint-engine-refit.md, "DeepSeek-V3 Benchmark", the NCCL
# column beside NIXL's, NeMo-RL of 2026-07; 32 policy nodes, 4 rollout nodes); assumed the same
# in v0.6, where the model's bytes give 6.8 s
NEMO_NCCL_REFIT_S = 14.21
# Beyond the list, the same v0.6 table's Qwen3-30B-A3B on-policy row on 32 H100s: GRPO 64
# prompts x 32 (G-GBS 2,048) in 4 optimizer steps of 512 (T-GBS), max sequence 4,096, average
# 3,203; v0.6.0's grpo-qwen3-30ba3b-4n8g.yaml over grpo_math_1B.yaml: colocated, engines of TP
# 2, training EP 8 x DP 32 without activation checkpointing, sequence packing into 4,096-token
# micro-batches, a reference (KL 0.01) and an old-logprob forward. Assumed: 150-token prompts
# as above, and responses lognormal with sigma 0.58 and mean 3,946 before the 3,946-token cap
# (3,053 after it: the table's 3,203 with the prompt)
# NeMo-RL's performance runs are 10 steps long (v0.6.0's tests/test_suites/llm/performance/*.sh:
# MAX_STEPS=10) and its table gives "the average of 5 steps"; assumed steps 5-9, the 5 its test
# suites average step times over (mean(..., -6, -1), 38 of the 70 step-time checks at v0.6.0)
NEMO_STEPS, NEMO_WINDOW = 10, (5, 9)
NEMO_QWEN3 = Workload(64, 32, 150, Lengths(3946, 3946, 0.58), extra_forwards=2, minibatches=4,
                      pack_tokens=4096, recompute="none")  # fmt: skip


def _areal(eta: int, published: float) -> Row:
    mode = "sync" if eta == 0 else "async"
    setup = Setup(gpu("h800"), 6, 2, mode=mode, staleness=eta, partial=eta > 0)
    return Row(f"AReaL 6:2 H800, staleness {eta}", published, "tok/s", "r1-distill-qwen-1.5b",
               AREAL, setup)  # fmt: skip


def _verl_colocated(gpus: int, published: float) -> Row:
    setup = Setup(gpu("h20"), gpus, gpus, colocated=True, engine_tp=2, train_sp=4)
    return Row(f"verl colocated sync, {gpus} H20", published, "s", "qwen2.5-math-7b",
               VERL_SYNC, setup, roles=("policy", "engine"))  # fmt: skip


def _verl_async(half: int, published: float) -> Row:
    setup = Setup(gpu("h20"), half, half, engine_tp=4, train_sp=4, mode="async",
                  staleness=0.5, partial=True, updates_per_sync=4)  # fmt: skip
    return Row(f"verl fully async {half}:{half} H20", published, "s", "qwen2.5-math-7b",
               VERL_ASYNC, setup, roles=("policy", "engine"))  # fmt: skip


def _nemo(gpus: int, published: float, mode: Literal["sync", "one_step"]) -> Row:
    if mode == "sync":
        setup = Setup(gpu("h100"), gpus, gpus, colocated=True, engine_tp=32, train_pp=16,
                      sync_method="gathered", sync_seconds=NEMO_REFIT_S, offload=True)  # fmt: skip
        name = f"NeMo-RL DeepSeek-V3 colocated, {gpus} H100"
    else:  # the engines on half the GPUs; in-flight weight updates: eta 1, partial rollouts
        half = gpus // 2
        setup = Setup(gpu("h100"), half, half, engine_tp=32, train_pp=16, mode="async",
                      staleness=1, partial=True, sync_seconds=NEMO_NCCL_REFIT_S)  # fmt: skip
        name = f"NeMo-RL DeepSeek-V3 one-step off-policy {half}:{half}, in-flight updates"
    return Row(name, published, "s", "deepseek-v3", NEMO, setup, NEMO_STEPS, NEMO_WINDOW)


def _nemo_qwen3(off: int, published: float) -> Row:
    """``off`` 0: on-policy, colocated on 32 GPUs; 1 (grpo-qwen3-30ba3b-4n8g-async-1off.yaml):
    16 generation and 16 training GPUs, training PP 2; 8 (...-24n8g-async-8off.yaml): 64
    generation and 128 training GPUs; both max_trajectory_age_steps ``off`` with in-flight
    weight updates (eta ``off``, partial rollouts) and NCCL's broadcast refit."""
    h100 = gpu("h100")
    if off == 0:
        setup = Setup(h100, 32, 32, colocated=True, engine_tp=2, train_ep=8, offload=True)
        return Row("NeMo-RL Qwen3-30B-A3B colocated, 32 H100", published, "s", "qwen3-30b-a3b",
                   NEMO_QWEN3, setup, NEMO_STEPS, NEMO_WINDOW)  # fmt: skip
    rollout, train, pp = (16, 16, 2) if off == 1 else (64, 128, 1)
    setup = Setup(h100, rollout, train, engine_tp=2, train_pp=pp, train_ep=8, mode="async",
                  staleness=off, partial=True)  # fmt: skip
    return Row(f"NeMo-RL Qwen3-30B-A3B {off}-step off-policy {rollout}:{train}, in-flight updates",
               published, "s", "qwen3-30b-a3b", NEMO_QWEN3, setup, NEMO_STEPS,
               NEMO_WINDOW)  # fmt: skip


ROWS: tuple[Row, ...] = (
    _areal(0, 27.1e3),
    _areal(1, 47.8e3),
    _areal(16, 52.0e3),
    _verl_colocated(32, 790.0),
    _verl_colocated(64, 365.0),
    _verl_colocated(128, 356.0),
    _verl_async(16, 295.0),
    _verl_async(32, 189.0),
    _verl_async(64, 151.0),
    _nemo(512, 111.0, "sync"),
    _nemo(256, 134.0, "sync"),
    _nemo(512, 64.1, "one_step"),
    _nemo_qwen3(0, 192.0),
    _nemo_qwen3(1, 152.0),
    _nemo_qwen3(8, 34.5),
)
"""Every published figure of SCALE.md's step-time table, in its order."""
