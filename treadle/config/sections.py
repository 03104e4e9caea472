"""The sections of the config tree other than ``data`` and ``algorithm``, and the tree itself."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

from treadle.config.algorithm import AlgorithmConfig
from treadle.config.data import DataConfig
from treadle.config.environment import EnvironmentConfig
from treadle.config.fields import at_least, at_most, below, bounded, finite, only, positive


def routes_to(domains: Collection[str], domain: str) -> bool:
    """Whether a function limited to ``domains`` (empty: every domain) scores ``domain``."""
    return not domains or domain in domains


EngineName = Literal["auto", "vllm", "sglang", "hf"]
"""The inference engines treadle ships."""

ParamScalar = bool | int | float | str
ParamValue = bool | int | float | str | list[ParamScalar]
"""A reward function's constructor param as YAML gives it: a number, a bool, a string or a list
of them (``params: {timeout_s: 10, strict: true, tags: [a, b]}``)."""


@dataclass
class RewardSpec:
    """One reward function of the mix."""

    name: str
    """A key of :data:`treadle.rewards.base.REWARD_FUNCTIONS`, e.g. ``"math_verify"``, or your
    own function's import path ``package.module:Name`` (a class implementing
    ``treadle.rewards.base.RewardFunction``, or a function ``(task, completion) -> float``)."""
    weight: float = bounded(finite(), default=1.0)
    """Multiplier of this function's reward in the total (unitless)."""
    params: dict[str, ParamValue] = field(default_factory=dict)
    """Constructor keyword arguments of the function: numbers, bools, strings or lists, e.g.
    ``{extract: boxed}`` or ``{timeout_s: 10}``."""
    domains: list[str] = field(default_factory=list)
    """Task domains this function scores (``Task.domain``, e.g. ``[math]``); empty: every
    domain. A sample gets the weighted sum of the functions routed to its domain."""

    def scores(self, domain: str) -> bool:
        """Whether this function scores samples of ``domain``."""
        return routes_to(self.domains, domain)


@dataclass
class RewardConfig:
    """The ``reward`` section of the config: which functions, and how they are run."""

    functions: list[RewardSpec]
    """Reward functions; the first is the primary verifier whose ``correct`` is reported."""
    timeout_s: float = bounded(positive(), finite(), default=5.0)
    """Wall-clock limit of one function on one sample, in seconds (ignored when workers=0, and
    by batched functions such as ``reward_model``, which take their own ``timeout_s``)."""
    step_timeout_s: float = bounded(positive(), finite(), default=120.0)
    """Wall-clock limit of scoring one batch as a whole, in seconds: one step's completions (in
    the asynchronous modes, one group's). Calls still running at the deadline are killed, calls
    still queued are never started; both score ``fallback`` and count as
    ``reward/deadline_misses``. Batched functions get the time left as their limit. With
    workers=0 a running call cannot be stopped; calls not started by the deadline still get
    the fallback."""
    fallback: float = bounded(finite(), default=0.0)
    """Reward a function gives a sample when it raised or timed out on it."""
    workers: int = bounded(at_least(0), default=2)
    """Worker processes; 0 scores in the calling process (debugging: no timeout)."""


@dataclass
class TinyModelConfig:
    """A small Qwen2-architecture model built locally with seeded random weights."""

    hidden_size: int = bounded(at_least(1), default=128)
    """Width of the residual stream."""
    intermediate_size: int = bounded(at_least(1), default=384)
    """Width of the MLP's hidden layer."""
    num_hidden_layers: int = bounded(at_least(1), default=2)
    """Transformer blocks."""
    num_attention_heads: int = 4
    """Attention heads. Head dim = hidden_size / heads; vLLM's CPU attention needs a head dim of
    32 or more."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention); divides ``num_attention_heads``."""
    max_position_embeddings: int = bounded(at_least(1), default=512)
    """Context length in tokens (prompt plus completion)."""
    tokenizer_vocab_size: int = 512
    """BPE vocabulary trained on the task's own text (digits stay single tokens)."""
    tokenizer_path: str | None = None
    """Use this local tokenizer folder (e.g. a real Qwen tokenizer) instead of training one."""


LORA_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""The attention and MLP projections of the Qwen2/Llama families."""


@dataclass
class LoraConfig:
    """``model.lora``: low-rank adapters (LoRA, arXiv:2106.09685) through PEFT. Each targeted
    linear ``W`` becomes ``W + (alpha / r) B A`` with ``A`` ``[r, in]``, ``B`` ``[out, r]`` (B
    starts at 0); only ``A`` and ``B`` train: the RL policy's and DPO's (the SFT warm-up's
    with ``sft``)."""

    r: int = bounded(at_least(0), default=0)
    """Adapter rank; 0: LoRA off (full fine-tuning)."""
    alpha: float = bounded(positive(), finite(), default=16.0)
    """LoRA's alpha: the adapter's update is scaled by ``alpha / r``."""
    target_modules: list[str] | str = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    """Names (last component) of the linear modules given adapters, or ``"all-linear"`` (every
    linear but the output layer)."""
    dropout: float = bounded(at_least(0.0), below(1.0), default=0.0)
    """Dropout on the adapter's input while training."""
    sync: Literal["merged", "adapter"] = "merged"
    """What the engine gets each sync: ``merged`` full weights (``W + scale B A``, Hugging Face
    names; any engine), or ``adapter``: the adapter tensors only, served over the base model by
    vLLM's LoRA support (``rollout.engine=vllm``)."""
    sft: bool = False
    """Also train adapters in the SFT warm-up (``sft.steps``) and its control run; they are
    merged into ``sft_model``, RL's starting (and KL reference) policy, which gets fresh
    adapters. False: the warm-up trains every weight (TRL's and verl's SFT trainers take their
    own LoRA setting apart from their RL trainers'; and a built tiny model's random weights
    are not a base an adapter can adapt)."""


@dataclass
class ModelConfig:
    """The ``model`` section: the policy's starting weights (the engine's dtype is
    ``rollout.dtype``)."""

    path: str | None = None
    """Local Hugging Face model folder (weights + tokenizer). None builds ``tiny``."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """The model built when ``path`` is None: its size, and its tokenizer."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters instead of full fine-tuning (``lora.r > 0``)."""


@dataclass
class NoiseConfig:
    """Imperfect demonstrations for SFT: what real demonstration data looks like."""

    loose_format_fraction: float = bounded(at_least(0.0), at_most(1), default=0.0)
    """Share of demonstrations that write the answer in ``loose_template`` instead."""
    loose_template: str = "{answer}"
    """Same fields as ``data.answer_template``."""
    wrong_answer_fraction: float = bounded(at_least(0.0), at_most(1), default=0.0)
    """Share of demonstrations whose answer is off by 1 to 3 (numeric answers only)."""


@dataclass
class SFTConfig:
    """The ``sft`` section: supervised warm-up on demonstrations before RL."""

    steps: int = bounded(at_least(0), default=0)
    """SFT warm-up optimizer steps before RL (0: none)."""
    batch_size: int = bounded(at_least(1), default=64)
    """Demonstrations per SFT optimizer step."""
    lr: float = bounded(positive(), finite(), default=1e-3)
    """Peak learning rate of the SFT warm-up (AdamW; cosine decay to 0 over ``sft.steps``)."""
    warmup_steps: int = 10
    """SFT steps of linear learning-rate warm-up from 0."""
    noise: NoiseConfig = field(default_factory=NoiseConfig)


@dataclass
class DPOConfig:
    """Direct Preference Optimization (``treadle dpo``) on pairs of a preferred (chosen) and a
    dispreferred (rejected) response to one prompt, against the starting model as reference."""

    path: str | None = None
    """jsonl of preference pairs, one JSON object per line. None synthesises pairs from the
    reasoning-gym data: the gold demonstration (``data.answer_template``) is chosen, the same
    with an answer off by 1 to 3 is rejected."""
    prompt_field: str = "prompt"
    """Field of the prompt: a string (one user message) or a list of ``{role, content}``."""
    chosen_field: str = "chosen"
    """Field of the preferred response text."""
    rejected_field: str = "rejected"
    """Field of the dispreferred response text."""
    beta: float = bounded(positive("e.g. 0.1"), finite(), default=0.1)
    """Strength of the implicit KL constraint to the reference (beta of arXiv:2305.18290 eq. 7)."""
    steps: int = bounded(at_least(1), default=100)
    """Optimizer steps."""
    batch_size: int = bounded(at_least(1), default=16)
    """Preference pairs per optimizer step."""
    lr: float = bounded(positive("e.g. 1e-5"), finite(), default=1e-5)
    """Learning rate of the policy (the rest of the optimizer comes from ``trainer``)."""


@dataclass
class RolloutConfig:
    """The ``rollout`` section: the inference engine and how it samples completions."""

    engine: EngineName | str = "vllm"
    """``vllm``, ``sglang`` (GPU only: SGLang does not install on CPU) or ``hf``, or your own
    engine class's import path ``package.module:Class`` (an ``InferenceEngine`` built as
    ``Class(spec)``; see :mod:`treadle.rollout.engines`). ``auto`` (opt-in): on a CPU ``hf``
    for a model under 1M parameters (transformers ``generate`` is faster there), else
    ``vllm``; ``vllm`` always in the asynchronous modes, with environments, LoRA adapter
    syncs, tensor parallel, Ray placement or a GPU (:mod:`treadle.rollout.engines.choice`;
    printed at start-up)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "float32"
    """Dtype of the inference engine's weights and compute (vLLM's ``dtype``, verl's
    ``actor_rollout_ref.rollout.dtype``), and of its KV cache. The trainer (RL, SFT, DPO) keeps
    fp32 master weights whatever this is, cast to it by the engine at each weight sync; for bf16
    compute in training use ``trainer.bf16_autocast``. ``auto`` (opt-in): ``bfloat16`` for a
    model of 100M parameters or more where bf16 runs natively (a GPU; a CPU with AMX or
    AVX512-BF16), else ``float32`` (bf16 is emulated, and slower, on an AVX2-only CPU). Was
    ``model.dtype``, still read with a warning."""
    preload: bool = True
    """Preload tcmalloc and Intel OpenMP (what vLLM's CPU backend asks for) into the vLLM
    engine's own process (``engine_process=own``) where ``scripts/install.sh`` put them; the
    trainer's process keeps torch's own allocator and OpenMP."""
    prompts_per_step: int = bounded(at_least(1), default=64)
    """Prompts per RL step, each sampled ``n`` times: a step trains on ``prompts_per_step * n``
    completions (verl's ``data.train_batch_size``)."""
    n: int = bounded(at_least(1), default=8)
    """Samples per prompt (the group size)."""
    temperature: float = bounded(finite(), positive("RL samples n > 1 per prompt"), default=1.0)
    """Sampling temperature of the rollouts (and of held-out pass@1)."""
    # The engines report logprobs of the top-p-renormalised distribution; the trainer does not
    # re-apply the nucleus cut, so the PPO ratio would be biased.
    top_p: float = bounded(only(1.0, "the trainer does not apply top-p"), default=1.0)
    """Nucleus sampling cut; only 1.0 (no cut) is supported."""
    max_tokens: int = bounded(at_least(1), default=32)
    """Most tokens sampled per completion (TRL's ``max_completion_length``); a completion
    that reaches it is truncated."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (the end-of-turn token always stops a completion)."""
    kv_cache_gib: float = bounded(at_least(0.0), default=0.0)
    """vLLM's KV-cache size (GiB, on CPU); 0: sized from the work (the most sequences the engine
    runs at once: a step's batch, or in the asynchronous modes ``max_running``; evaluation runs
    in waves of that many), each at the longest prompt plus ``max_tokens``, and at least one
    request of the engine's ``max_model_len``: the model's context, at most 8,192; see
    :mod:`treadle.rollout.engines.sizing`). A set size must hold that one request too, or vLLM
    refuses to start."""
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    """When generation runs relative to the update. ``sync``: each step generates its batch,
    then trains on it (on-policy). ``one_step_off``:
    the rollout of step k+1 runs during the update of step k (one version stale at most).
    ``async``: generation never waits for the trainer beyond the staleness bound
    (``max_staleness``); see :mod:`treadle.rollout.scheduler`."""
    max_staleness: int = bounded(at_least(0), default=1)
    """``async``: eta, the most policy versions a trained token may lag the trainer."""
    partial: bool = False
    """``async``: at a weight sync, abort running requests and continue them with the new
    weights from where they stopped (partial rollouts); else they finish on the old weights."""
    oversample: int = bounded(at_least(0), default=0)
    """``one_step_off``/``async``: extra groups in flight beyond the batch; at a weight sync the
    stragglers are aborted (dropped, or continued with ``partial``)."""
    max_running: int = bounded(at_least(0), default=0)
    """``one_step_off``/``async``: most requests in the engine at once; the started groups' other
    requests wait in the scheduler and go in oldest group first (continuations of aborted
    samples before new samples). Each running request gets one token per engine step, so
    running more makes every one slower and the longest more likely to exceed the staleness
    bound. 0: a quarter of a step's samples (``prompts_per_step * n / 4``, at least ``n``) on a
    CPU, where an engine step costs about the same per token at any batch size; no limit on a
    GPU, whose decode steps cost about the same at any batch size."""
    engine_process: Literal["auto", "same", "own"] = "auto"
    """Where the engine runs with ``placement.mode=single``: ``same`` (this process: a weight
    sync passes the tensors themselves), ``own`` (a process of its own, bound to the second half
    of this process's CPU cores, which generates while the trainer trains on the first half:
    the asynchronous modes' overlap is then real, not two threads taking turns in one Python
    interpreter; weights cross as a file in shared memory), or ``auto``: ``own`` in
    ``one_step_off`` and ``async`` on a machine without a GPU and with 2 cores or more, with
    ``rollout.tensor_parallel=1``; else ``same``."""
    tensor_parallel: int = bounded(at_least(1), default=1)
    """Tensor-parallel ranks of the engine (vLLM's ``tensor_parallel_size``, SGLang's
    ``tp_size``), for ``vllm`` and ``sglang`` with ``placement.mode=single``. vLLM runs its ranks
    as worker processes (its ``mp`` executor; on CPU over gloo and shared memory, each rank bound
    to its own cores); the attention and KV heads must divide by it. A weight sync sends the
    full Hugging Face tensors and each rank loads its own slice. ``kv_cache_gib`` is per rank.
    With N > 1 vLLM samples in its worker processes, so a seeded batch (evaluation's
    ``run.seed``) is not reproducible from call to call (checked on CPU)."""

    @property
    def staleness_bound(self) -> int:
        """The versions a trained token may lag the trainer in this mode: 0 in ``sync``, 1 in
        ``one_step_off``, ``max_staleness`` in ``async``."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)


@dataclass
class MegatronConfig:
    """The ``trainer.megatron`` section: megatron-core's model parallelism
    (``trainer.backend: megatron``, :mod:`treadle.train.megatron_backend`)."""

    tensor_parallel: int = bounded(at_least(1), default=1)
    """Tensor-parallel ranks (trainer processes) each layer's matrices are split over; it must
    divide the KV heads, the MLP width and the vocabulary. 1: one process, no split."""
    pipeline_parallel: int = bounded(at_least(1), default=1)
    """Pipeline-parallel stages the layers are split into (only 1 is implemented)."""


@dataclass
class DeepSpeedConfig:
    """The ``trainer.deepspeed`` section: DeepSpeed ZeRO (``trainer.backend=deepspeed``,
    :mod:`treadle.train.deepspeed_backend`)."""

    zero_stage: Literal[1, 2, 3] = 2
    """ZeRO stage: 1 partitions the optimizer state across ranks, 2 also the gradients, 3 also
    the weights (gathered layer by layer for each forward and backward)."""
    offload_optimizer: bool = False
    """Keep the optimizer state (fp32 master weights, Adam's moments) and its step in CPU memory
    (ZeRO-Offload) instead of the accelerator's; needs a CUDA device (on a CPU-only machine the
    state is in CPU memory already, and this is refused)."""


@dataclass
class TrainerConfig:
    """The ``trainer`` section: the policy's optimizer and how a batch is split into updates."""

    backend: Literal["torch", "deepspeed", "megatron"] = "torch"
    """Training backend (:mod:`treadle.train.backends`): ``torch`` (PyTorch in this process;
    FSDP2 across Ray trainer ranks), ``deepspeed`` (ZeRO, ``trainer.deepspeed``) or
    ``megatron`` (megatron-core tensor/pipeline parallelism, ``trainer.megatron``)."""

    lr: float = bounded(positive(), finite(), default=1e-4)
    """Peak learning rate of the policy's AdamW optimizer (after warm-up)."""
    weight_decay: float = bounded(at_least(0.0), default=0.0)
    """AdamW's decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW's (beta1, beta2)."""
    grad_clip: float = bounded(at_least(0.0), default=1.0)
    """Max global grad norm; 0 turns clipping off (as ``max_grad_norm=0`` in transformers)."""
    warmup_steps: int = bounded(at_least(0), default=0)
    """Optimizer steps of linear learning-rate warm-up from 0 (0: none)."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning rate after warm-up: constant, or a cosine or linear decay to 0 at the last
    optimizer step."""
    micro_batch_tokens: int = bounded(at_least(16), default=512)
    """Token budget of one packed micro-batch (no padding is computed)."""
    bf16_autocast: bool = False
    """Autocast forward/backward to bf16 (helps on GPUs and bf16 CPUs); weights stay fp32."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (:mod:`treadle.train.checkpointing`): activation memory of about one hidden state per layer,
    for about one more forward pass of compute. Policy and critic, one process or FSDP2 ranks."""
    mini_batches: int = bounded(at_least(1), default=1)
    """Optimizer steps per RL step (the batch is split; later ones are off-policy, clipped)."""
    peak_tflops: float = bounded(at_least(0.0), default=0.0)
    """Peak TFLOP/s of the trainer's device that ``perf/mfu`` divides by; 0: a known GPU's from
    a table by name, else measured once (a matmul in the trainer's dtype, about 0.2 s)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """megatron-core's parallelism (read when ``backend`` is ``megatron``)."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """DeepSpeed's settings (read with ``trainer.backend=deepspeed``)."""


@dataclass
class EvalConfig:
    """The ``eval`` section: held-out accuracy during and after training."""

    every: int = bounded(at_least(0), default=0)
    """Evaluate held-out accuracy every N RL steps (0: only before and after RL)."""
    samples_per_prompt: int = bounded(at_least(1), default=8)
    """Sampled completions per prompt (n): pass@1 is averaged over them; ``eval/pass@k`` is
    pass@n."""
    k: list[int] = field(default_factory=list)
    """More k to report the unbiased pass@k for (Chen et al. 2021, arXiv:2107.03374, eq. 1),
    each from 1 to ``samples_per_prompt``, e.g. ``[1, 4, 8]`` (logged as ``eval/pass@4``...)."""
    temperature: float | None = None
    """Sampling temperature of evaluation; None: ``rollout.temperature``, so training's own
    numbers are reproduced. Greedy accuracy is always at temperature 0."""
    split: Literal["held_out", "all"] = "held_out"
    """What ``treadle eval`` evaluates: ``held_out``, the held-out split of each data source as
    in training (``data.eval_size``); ``all``, every row of ``data.path`` (and of each
    ``data.mix`` file), with no training split (e.g. all 500 of MATH-500). Training itself
    always evaluates the held-out split."""
    greedy: bool = True
    """Also evaluate greedy decoding (``eval/greedy_accuracy``)."""
    control_sft: bool = False
    """After RL, also spend the same wall time on SFT from the SFT checkpoint and evaluate it."""


@dataclass
class RunConfig:
    """The ``run`` section: its name, output folder, length, and checkpoints."""

    name: str = "default"
    """Name of the run: its directory is ``run.output_dir/run.name``."""
    output_dir: str = "runs"
    """Folder of the run directories (relative to the working directory)."""
    seed: int = 0
    """Seed of the model build, sampling, the prompt order and the trainer (``data.seed``
    seeds the prompts themselves)."""
    steps: int = bounded(at_least(0), default=20)
    """RL steps (one batch of rollouts each)."""
    save_every: int = bounded(at_least(1), default=10)
    """Checkpoint every N RL steps (and after the last one)."""
    keep_last: int = bounded(at_least(2), default=2)
    """Checkpoints kept (the newest ones): at least two, so a checkpoint found corrupt on
    resume has an older one to fall back to."""
    checkpoint_on_stop: bool = True
    """On SIGTERM or SIGINT, checkpoint the step the run stops after even when no checkpoint
    is due (False: only at ``save_every``; the steps since the last one are then redone)."""
    samples_to_log: int = 16
    """Completions saved per step under samples/."""
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(
        default_factory=lambda: ["tensorboard"]
    )
    """Where the RL metrics go besides ``metrics.jsonl`` (always written): ``tensorboard``
    (``RUN/tensorboard``), ``wandb`` (``pip install 'treadle[wandb]'``; files under
    ``RUN/wandb``; ``WANDB_MODE=offline`` logs without a network, ``wandb sync`` uploads later),
    ``mlflow`` (``pip install 'treadle[mlflow]'``; a file store ``RUN/mlruns`` unless
    ``MLFLOW_TRACKING_URI`` is set)."""
    project: str = "treadle"
    """The wandb project and the MLflow experiment the run is logged under (``run.loggers``);
    the run's name there is ``run.name``."""
    threads: int = bounded(at_least(1), default=2)
    """torch intra-op threads (give each compute process its own cores)."""


@dataclass
class PlacementConfig:
    """Where the roles run. ``single``: everything in this process, no cluster (the default).
    ``colocated`` / ``disaggregated``: Ray actors in one placement group (a local Ray is started
    when none is running): ``trainers`` FSDP2 trainer workers forming one torch.distributed group
    and ``engines`` rollout workers; colocated puts engine ``j`` in trainer ``j``'s bundle (they
    share its devices), disaggregated gives every worker its own bundle."""

    mode: Literal["single", "colocated", "disaggregated"] = "single"
    """Where the roles run: this process, or Ray actors sharing or not sharing devices (see
    the section's description)."""
    trainers: int = bounded(at_least(1), default=2)
    """Trainer workers (FSDP2 ranks)."""
    engines: int = bounded(at_least(1), default=1)
    """Engine (rollout) workers, each with its own inference engine."""
    trainer_cpus: float = bounded(at_least(0.0), default=1.0)
    """CPUs of one trainer worker's bundle (Ray resources)."""
    engine_cpus: float = bounded(at_least(0.0), default=1.0)
    """CPUs of one engine worker's bundle (Ray resources)."""
    trainer_gpus: float = bounded(at_least(0.0), default=0.0)
    """GPUs of one trainer worker's bundle (1 on a GPU cluster; 0 here)."""
    engine_gpus: float = bounded(at_least(0.0), default=0.0)
    """GPUs of one engine worker's bundle (1 on a GPU cluster; 0 here)."""
    threads: int = bounded(at_least(1), default=1)
    """torch intra-op threads of each worker process (1 on a 2-core machine)."""
    weight_sync: Literal["auto", "shared_memory", "collective", "disk"] = "auto"
    """Trainer -> engine transport. ``auto``: shared memory when colocated, a collective
    (each trainer rank sends its shards point to point over torch.distributed, into the engines'
    buckets) when disaggregated. ``disk``: the reference."""
    bucket_mb: int = bounded(at_least(1), default=64)
    """Bucket size of the collective transport, in MiB."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend of the trainer ranks: ``auto`` is NCCL with GPUs, gloo without
    (the weight-sync group is gloo either way)."""
    engine_restarts: int = bounded(at_least(0), default=3)
    """How many times a dead engine worker is restarted in one run before the run fails."""


@dataclass
class Config:
    """The whole config tree: one section per component (``run``, ``model``, ``data``, ...)."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    reward: RewardConfig = field(
        default_factory=lambda: RewardConfig(functions=[RewardSpec("reasoning_gym")])
    )
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
