"""One typed config tree, loaded from a YAML recipe plus dotted command-line overrides.

Each component owns its section. Loading validates every key and type: a misspelt key names its
dotted path and suggests the closest valid key; a wrong type names the path and the expected
type. Both raise :class:`treadle.core.errors.UserError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import string
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from treadle.core.errors import UserError


def routes_to(domains, domain: str) -> bool:
    """Whether a function limited to ``domains`` (empty: every domain) scores ``domain``."""
    return not domains or domain in domains


@dataclass
class RewardSpec:
    """One reward function of the mix."""

    name: str
    """A key of :data:`treadle.rewards.base.REWARD_FUNCTIONS`, e.g. ``"math_verify"``."""
    weight: float = 1.0
    """Multiplier of this function's reward in the total (unitless)."""
    params: dict[str, str] = field(default_factory=dict)
    """Constructor keyword arguments of the function, e.g. ``{"extract": "boxed"}``."""
    domains: list[str] = field(default_factory=list)
    """Task domains this function scores (``Task.domain``, e.g. ``[math]``); empty: every
    domain. A sample gets the weighted sum of the functions routed to its domain."""

    def scores(self, domain: str) -> bool:
        return routes_to(self.domains, domain)


@dataclass
class RewardConfig:
    """The ``reward`` section of the config: which functions, and how they are run."""

    functions: list[RewardSpec]
    """Reward functions; the first is the primary verifier whose ``correct`` is reported."""
    timeout_s: float = 5.0
    """Wall-clock limit of one function on one sample, in seconds (ignored when workers=0, and
    by batched functions such as ``reward_model``, which take their own ``timeout_s``)."""
    fallback: float = 0.0
    """Reward a function gives a sample when it raised or timed out on it."""
    workers: int = 2
    """Worker processes; 0 scores in the calling process (debugging: no timeout)."""


@dataclass
class TinyModelConfig:
    """A small Qwen2-architecture model built locally with seeded random weights."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    """Head dim = hidden_size / heads; vLLM's CPU attention needs a head dim of 32 or more."""
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    tokenizer_vocab_size: int = 512
    """BPE vocabulary trained on the task's own text (digits stay single tokens)."""
    tokenizer_path: str | None = None
    """Use this local tokenizer folder (e.g. a real Qwen tokenizer) instead of training one."""


@dataclass
class ModelConfig:
    path: str | None = None
    """Local Hugging Face model folder (weights + tokenizer). None builds ``tiny``."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the engine serves in; the trainer keeps fp32 master weights (for bf16 compute in
    training use ``trainer.bf16_autocast``)."""


DataSource = Literal["reasoning_gym", "jsonl", "parquet", "humaneval", "mbpp"]


@dataclass
class MixConfig:
    """One more data source mixed into training (``data.mix``), with its own domain."""

    source: DataSource
    weight: float
    """Share of training prompts from this source, relative to ``data.weight`` and the others."""
    domain: str
    """Task domain of these prompts (routes them to ``reward.functions[i].domains``)."""
    path: str | None = None
    question_field: str = "question"
    answer_field: str = "answer"
    answer_pattern: str | None = None
    task: str = "chain_sum"
    task_params: dict[str, int | float | str] = field(default_factory=dict)
    size: int = 2000
    eval_size: int = 50


@dataclass
class DataConfig:
    source: DataSource = "reasoning_gym"
    """``humaneval`` (HumanEval.jsonl.gz) and ``mbpp`` (sanitized-mbpp.json) give code tasks
    whose tests the ``code`` reward runs."""
    path: str | None = None
    """jsonl/parquet file (for those sources)."""
    question_field: str = "question"
    answer_field: str = "answer"
    answer_pattern: str | None = None
    """Regex applied to the answer column; group 1 is the gold answer (e.g. GSM8K ``#### (.+)``)."""
    task: str = "chain_sum"
    """reasoning-gym dataset name (for that source)."""
    task_params: dict[str, int | float | str] = field(default_factory=dict)
    """reasoning-gym dataset parameters, e.g. ``{min_terms: 2, max_terms: 3}``."""
    size: int = 2000
    """Number of training prompts generated (reasoning-gym) or read at most (files)."""
    seed: int = 42
    domain: str = "math"
    eval_size: int = 100
    """Held-out prompts, never trained on (deduplicated against the training prompts)."""
    system_prompt: str | None = None
    answer_template: str = "<answer>{answer}</answer>"
    """An SFT demonstration: ``{answer}`` is the gold answer, ``{reasoning}`` its worked steps."""
    reasoning: Literal["none", "chain_steps"] = "none"
    """Worked steps for demonstrations: ``chain_steps`` evaluates a reasoning-gym +/- chain
    left to right (``3 + 4 = 7, 7 - 9 = -2.``)."""
    weight: float = 1.0
    """Share of training prompts from this (the main) source when ``mix`` adds others."""
    mix: list[MixConfig] = field(default_factory=list)
    """More sources, e.g. ``[{source: mbpp, path: ..., domain: code, weight: 0.3}]``: training
    prompts are drawn from all of them in proportion to their weights; held-out prompts of each
    source are evaluated together."""


@dataclass
class NoiseConfig:
    """Imperfect demonstrations for SFT: what real demonstration data looks like."""

    loose_format_fraction: float = 0.0
    """Share of demonstrations that write the answer in ``loose_template`` instead."""
    loose_template: str = "{answer}"
    """Same fields as ``data.answer_template``."""
    wrong_answer_fraction: float = 0.0
    """Share of demonstrations whose answer is off by 1 to 3 (numeric answers only)."""


@dataclass
class SFTConfig:
    steps: int = 0
    """SFT warm-up optimizer steps before RL (0: none)."""
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 10
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
    beta: float = 0.1
    """Strength of the implicit KL constraint to the reference (beta of arXiv:2305.18290 eq. 7)."""
    steps: int = 100
    """Optimizer steps."""
    batch_size: int = 16
    """Preference pairs per optimizer step."""
    lr: float = 1e-5
    """Learning rate of the policy (the rest of the optimizer comes from ``trainer``)."""


@dataclass
class RolloutConfig:
    engine: Literal["vllm", "hf"] = "vllm"
    prompts_per_step: int = 64
    n: int = 8
    """Samples per prompt (the group size)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 32
    stop: list[str] = field(default_factory=list)
    """Stop strings (the end-of-turn token always stops a completion)."""
    kv_cache_gib: float = 1.0
    """vLLM CPU KV-cache size (GiB)."""


@dataclass
class KLConfig:
    """KL to a frozen reference (the starting policy). ``coef`` 0 loads no reference model."""

    coef: float = 0.0
    estimator: Literal["k1", "k2", "k3", "low_var_k3"] = "k3"
    """Per-token estimator of KL(policy || reference); see ALGORITHMS.md for each one."""
    placement: Literal["loss", "reward"] = "loss"
    """``loss``: ``coef * KL`` added to each token's loss (GRPO). ``reward``: ``-coef * KL`` of
    the sampling policy added to each token's reward before advantages (InstructGPT PPO,
    REINFORCE++, RLOO)."""


@dataclass
class CriticConfig:
    """The value model of PPO (``algorithm.advantage=gae``): the policy's architecture and
    starting weights with a one-output value head instead of the LM head."""

    lr: float = 1.0e-4
    value_clip: float = 0.2
    """Clip of the value change per update around the old value (0: unclipped)."""


GROUP_BASELINES = frozenset({"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"})
"""Advantage estimators whose baseline is the other samples of the prompt (its group): they need
``rollout.n >= 2``, and only they lose all signal on a group whose rewards are equal."""


@dataclass
class AlgorithmConfig:
    advantage: Literal[
        "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "gae"
    ] = "grpo"
    """Advantage estimator (``gae`` trains a critic; ``remax`` samples a greedy baseline)."""
    policy_loss: Literal["ppo", "gspo", "vanilla"] = "ppo"
    """``ppo``: clipped token ratio (DAPO's clip-higher when clip_eps_high > clip_eps_low);
    ``gspo``: clipped sequence ratio; ``vanilla``: unclipped policy gradient."""
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float = 0.0
    """Dual-clip bound c (> 1) on negative-advantage tokens' loss (verl uses 3); 0: off."""
    loss_agg: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses become the step's loss (``-norm`` divides by rollout.max_tokens)."""
    kl: KLConfig = field(default_factory=KLConfig)
    entropy_coef: float = 0.0
    """Entropy bonus weight (the loss subtracts ``coef * entropy``); entropy is always logged."""
    gamma: float = 1.0
    """Per-token discount (GAE, REINFORCE++)."""
    lam: float = 0.95
    """GAE lambda."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal, sample more prompts to refill the batch."""
    max_sampling_rounds: int = 3
    """Dynamic sampling's cap on generation rounds per step; then the step trains on what it
    has (logged as ``filter/kept_groups``)."""
    overlong_filter: bool = False
    """DAPO: truncated completions (hit rollout.max_tokens) are not trained on."""
    overlong_cache: int = 0
    """DAPO soft overlong punishment: the last this-many tokens of rollout.max_tokens cost up to
    -1 reward, linearly (0: off)."""
    importance_sampling: Literal["none", "tis_token", "tis_seq", "mis_token", "mis_seq"] = "none"
    """Correction for the engine/trainer mismatch; anything but ``none`` recomputes the old
    logprobs with the trainer before the update."""
    is_threshold: float = 2.0
    """C of the correction: TIS truncates weights at C; MIS drops weights outside [1/C, C]."""
    critic: CriticConfig = field(default_factory=CriticConfig)


@dataclass
class TrainerConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0
    """Max global grad norm; 0 turns clipping off (as ``max_grad_norm=0`` in transformers)."""
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    micro_batch_tokens: int = 512
    """Token budget of one packed micro-batch (no padding is computed)."""
    bf16_autocast: bool = False
    """Autocast forward/backward to bf16 (helps on GPUs and bf16 CPUs); weights stay fp32."""
    mini_batches: int = 1
    """Optimizer steps per RL step (the batch is split; later ones are off-policy, clipped)."""


@dataclass
class EvalConfig:
    every: int = 0
    """Evaluate held-out accuracy every N RL steps (0: only before and after RL)."""
    samples_per_prompt: int = 8
    """pass@1 is averaged over these samples; pass@k uses k = this."""
    greedy: bool = True
    control_sft: bool = False
    """After RL, also spend the same wall time on SFT from the SFT checkpoint and evaluate it."""


@dataclass
class RunConfig:
    name: str = "default"
    output_dir: str = "runs"
    seed: int = 0
    steps: int = 20
    """RL steps (one batch of rollouts each)."""
    save_every: int = 10
    keep_last: int = 2
    samples_to_log: int = 16
    """Completions saved per step under samples/."""
    threads: int = 2
    """torch intra-op threads (give each compute process its own cores)."""


@dataclass
class PlacementConfig:
    """Where the roles run. ``single``: everything in this process, no cluster (the default).
    ``colocated`` / ``disaggregated``: Ray actors in one placement group (a local Ray is started
    when none is running): ``trainers`` FSDP2 trainer workers forming one torch.distributed group
    and ``engines`` rollout workers; colocated puts engine ``j`` in trainer ``j``'s bundle (they
    share its devices), disaggregated gives every worker its own bundle."""

    mode: Literal["single", "colocated", "disaggregated"] = "single"
    trainers: int = 2
    """Trainer workers (FSDP2 ranks)."""
    engines: int = 1
    """Engine (rollout) workers, each with its own inference engine."""
    trainer_cpus: float = 1.0
    """CPUs of one trainer worker's bundle (Ray resources)."""
    engine_cpus: float = 1.0
    trainer_gpus: float = 0.0
    """GPUs of one trainer worker's bundle (1 on a GPU cluster; 0 here)."""
    engine_gpus: float = 0.0
    threads: int = 1
    """torch intra-op threads of each worker process (1 on a 2-core machine)."""
    weight_sync: Literal["auto", "shared_memory", "collective", "disk"] = "auto"
    """Trainer -> engine transport. ``auto``: shared memory when colocated, a collective
    (bucketed broadcast over torch.distributed) when disaggregated. ``disk``: the reference."""
    bucket_mb: int = 64
    """Bucket size of the collective transport, in MiB."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: ``auto`` is NCCL with GPUs, gloo without."""
    engine_restarts: int = 3
    """How many times a dead engine worker is restarted in one run before the run fails."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(
        default_factory=lambda: RewardConfig(functions=[RewardSpec("reasoning_gym")])
    )
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load a YAML recipe, apply ``a.b.c=value`` overrides, validate, and build the tree.

    A recipe may start from another: ``base: default.yaml`` (relative to the recipe) loads that
    one first and lays this recipe's keys over it.

    Raises:
        UserError: missing/unparsable recipe, unknown key (with a "did you mean"), wrong type,
            or a malformed override.
    """
    raw: dict[str, Any] = _read_recipe(Path(path), ()) if path is not None else {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r} must look like section.key=value")
        _set_dotted(raw, key.strip(), _Override(value))
    cfg = _build(Config, raw, "")
    _check(cfg)
    return cfg


def _read_recipe(p: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    """A recipe's raw mapping, with its ``base:`` recipe (a path relative to it) merged under it:
    the recipe's own values win, sections merge key by key, lists are replaced whole."""
    if not p.is_file():
        where = f" (the base of {seen[-1]})" if seen else ""
        raise UserError(
            f"recipe {p}{where} does not exist; pass a YAML file such as recipes/default.yaml"
        )
    if p.resolve() in seen:
        raise UserError(f"recipe {p}: its base: chain loops back to itself")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"recipe {p} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise UserError(f"recipe {p} must be a mapping of sections (run:, model:, ...)")
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise UserError(f"recipe {p}: base must be a recipe path, got {base!r}")
    return _merge(_read_recipe(p.parent / base, (*seen, p.resolve())), raw)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data (for ``config.yaml`` in the run directory)."""
    return dataclasses.asdict(cfg)


@dataclass(frozen=True)
class _Override:
    """The text of a command-line value; parsed once its field's type is known, so a string
    field takes the text as written (``{answer}`` stays a string, not a YAML mapping)."""

    text: str

    def resolve(self, tp: Any, path: str) -> Any:
        text_only = set(typing.get_args(tp)) == {str, type(None)} and self.text not in ("", "null")
        if tp is str or text_only:
            return self.text
        try:
            return yaml.safe_load(self.text) if self.text else None
        except yaml.YAMLError as e:
            raise UserError(f"override {path}={self.text}: not a valid value ({e})") from None


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"override {key}: {part} is a value, not a section")
    node[leaf] = value


def _build(cls: type, raw: Any, path: str) -> Any:
    if not isinstance(raw, dict):
        raise UserError(f"config {path or '<root>'}: expected a section (mapping), got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean {path + '.' if path else ''}{close[0]}?" if close else ""
            raise UserError(f"config: unknown key {dotted}{hint} (valid: {', '.join(fields)})")
        kwargs[key] = _coerce(hints[key], value, dotted)
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        where = ", ".join(f"{path}.{m}" if path else m for m in missing)
        raise UserError(f"config: missing required key {where}")
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    if isinstance(value, _Override):
        value = value.resolve(tp, path)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, path)
            except UserError as e:
                errors.append(str(e))
        raise UserError(
            errors[-1]
            if len(errors) == 1
            else f"config {path}: expected {_name(tp)}, got {value!r}"
        )
    if origin is Literal:
        if value not in args:
            raise UserError(
                f"config {path}: expected one of {', '.join(map(repr, args))}, got {value!r}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"config {path}: expected a list, got {value!r}")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise UserError(f"config {path}: expected a list of {len(args)} values, got {value!r}")
        return tuple(
            _coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"config {path}: expected a mapping, got {value!r}")
        return {str(k): _coerce(args[1], v, f"{path}.{k}") for k, v in value.items()}
    return _scalar(tp, value, path)


def _scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-5" as a string
            return float(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if tp in (int, bool, str) and type(value) is tp:
        return value
    raise UserError(f"config {path}: expected {_name(tp)}, got {type(value).__name__} {value!r}")


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_model(cfg: Config) -> None:
    """Geometry of the built tiny model, which would otherwise fail deep inside torch or vLLM."""
    if cfg.model.path is not None:
        return
    t = cfg.model.tiny
    if t.num_attention_heads < 1 or t.hidden_size % t.num_attention_heads:
        raise UserError("config model.tiny.hidden_size: must be a multiple of num_attention_heads")
    if t.num_key_value_heads < 1 or t.num_attention_heads % t.num_key_value_heads:
        raise UserError("config model.tiny.num_key_value_heads: must divide num_attention_heads")
    if cfg.rollout.engine == "vllm" and t.hidden_size // t.num_attention_heads < 32:
        raise UserError(
            "config model.tiny.num_attention_heads: vLLM's CPU attention needs a head dim "
            "(hidden_size / num_attention_heads) of at least 32"
        )


def _check(cfg: Config) -> None:
    """Cross-field checks that types alone cannot express."""
    bounds = {
        "run.steps": (cfg.run.steps, 0),
        "rollout.n": (cfg.rollout.n, 1),
        "rollout.prompts_per_step": (cfg.rollout.prompts_per_step, 1),
        "rollout.max_tokens": (cfg.rollout.max_tokens, 1),
        "run.save_every": (cfg.run.save_every, 1),
        "run.keep_last": (cfg.run.keep_last, 1),
        "trainer.micro_batch_tokens": (cfg.trainer.micro_batch_tokens, 16),
        "trainer.mini_batches": (cfg.trainer.mini_batches, 1),
        "data.size": (cfg.data.size, 1),
        "eval.samples_per_prompt": (cfg.eval.samples_per_prompt, 1),
        "eval.every": (cfg.eval.every, 0),
        "data.eval_size": (cfg.data.eval_size, 1),
        "sft.steps": (cfg.sft.steps, 0),
        "sft.batch_size": (cfg.sft.batch_size, 1),
        "algorithm.kl.coef": (cfg.algorithm.kl.coef, 0.0),
        "algorithm.entropy_coef": (cfg.algorithm.entropy_coef, 0.0),
        "algorithm.dual_clip": (cfg.algorithm.dual_clip, 0.0),
        "algorithm.max_sampling_rounds": (cfg.algorithm.max_sampling_rounds, 1),
        "algorithm.overlong_cache": (cfg.algorithm.overlong_cache, 0),
        "algorithm.critic.value_clip": (cfg.algorithm.critic.value_clip, 0.0),
        "algorithm.gamma": (cfg.algorithm.gamma, 0.0),
        "algorithm.lam": (cfg.algorithm.lam, 0.0),
        "algorithm.clip_eps_low": (cfg.algorithm.clip_eps_low, 0.0),
        "algorithm.clip_eps_high": (cfg.algorithm.clip_eps_high, 0.0),
        "trainer.grad_clip": (cfg.trainer.grad_clip, 0.0),
        "trainer.weight_decay": (cfg.trainer.weight_decay, 0.0),
        "trainer.warmup_steps": (cfg.trainer.warmup_steps, 0),
        "dpo.steps": (cfg.dpo.steps, 1),
        "dpo.batch_size": (cfg.dpo.batch_size, 1),
        "placement.trainers": (cfg.placement.trainers, 1),
        "placement.engines": (cfg.placement.engines, 1),
        "placement.trainer_cpus": (cfg.placement.trainer_cpus, 0.0),
        "placement.engine_cpus": (cfg.placement.engine_cpus, 0.0),
        "placement.trainer_gpus": (cfg.placement.trainer_gpus, 0.0),
        "placement.engine_gpus": (cfg.placement.engine_gpus, 0.0),
        "placement.threads": (cfg.placement.threads, 1),
        "placement.bucket_mb": (cfg.placement.bucket_mb, 1),
        "placement.engine_restarts": (cfg.placement.engine_restarts, 0),
    }
    for key, (value, least) in bounds.items():
        if not (math.isfinite(value) and value >= least):  # also rejects nan and inf
            raise UserError(f"config {key}: must be at least {least} (and finite), got {value}")
    if cfg.rollout.temperature <= 0:
        raise UserError("config rollout.temperature: must be > 0 (RL samples n > 1 per prompt)")
    _check_placement(cfg)
    if not (cfg.trainer.lr > 0 and cfg.sft.lr > 0):  # also rejects nan
        raise UserError("config trainer.lr / sft.lr: must be positive")
    for key, value in (("dpo.lr", cfg.dpo.lr), ("dpo.beta", cfg.dpo.beta)):
        if not value > 0:  # also rejects nan
            raise UserError(f"config {key}: must be positive (e.g. 1e-5 and 0.1), got {value}")
    if cfg.algorithm.clip_eps_low >= 1:
        raise UserError(
            "config algorithm.clip_eps_low: must be below 1 (the ratio floor is 1 - eps)"
        )
    if cfg.rollout.top_p != 1.0:
        # The engines report logprobs of the top-p-renormalised distribution; the trainer does
        # not re-apply the nucleus cut, so the PPO ratio would be biased.
        raise UserError(
            "config rollout.top_p: only 1.0 is supported (the trainer does not apply top-p)"
        )
    _check_model(cfg)
    sources = [("data", cfg.data.source, cfg.data.domain, cfg.data.path, cfg.data.weight)]
    sources += [
        (f"data.mix[{i}]", m.source, m.domain, m.path, m.weight) for i, m in enumerate(cfg.data.mix)
    ]
    for key, source, domain, path, weight in sources:
        rg_functions = [
            f for f in cfg.reward.functions if f.name == "reasoning_gym" and f.scores(domain)
        ]
        if source != "reasoning_gym" and rg_functions:
            raise UserError(
                f"config reward.functions: reasoning_gym scores only reasoning_gym tasks, but it "
                f"is routed to {key}'s domain {domain!r} ({source}); use math_verify for file data "
                "(e.g. reward.functions='[{name: math_verify}]'), or give it domains"
            )
        if source != "reasoning_gym" and not path:
            raise UserError(f"config {key}.path: required for source={source}")
        if not (math.isfinite(weight) and weight > 0):
            raise UserError(f"config {key}.weight: must be a positive number, got {weight}")
    if cfg.data.reasoning != "none" and cfg.data.source != "reasoning_gym":
        raise UserError("config data.reasoning: chain_steps needs data.source=reasoning_gym")
    _check_algorithm(cfg)
    if not cfg.reward.functions:
        raise UserError("config reward.functions: list at least one reward function")
    for key, template in (
        ("data.answer_template", cfg.data.answer_template),
        ("sft.noise.loose_template", cfg.sft.noise.loose_template),
    ):
        try:
            fields = {
                name for _, name, _, _ in string.Formatter().parse(template) if name is not None
            }
        except ValueError as e:
            raise UserError(f"config {key}: {e}") from None
        if not fields <= {"answer", "reasoning"}:
            raise UserError(
                f"config {key}: only {{answer}} and {{reasoning}} may appear, got {sorted(fields)}"
            )


def _check_placement(cfg: Config) -> None:
    p = cfg.placement
    if p.mode == "single":
        return
    if p.mode == "colocated" and p.engines > p.trainers:
        raise UserError(
            f"config placement.engines: colocated puts each engine in a trainer's bundle, so at "
            f"most placement.trainers ({p.trainers}) engines, got {p.engines}"
        )
    if cfg.algorithm.kl.coef > 0 or cfg.algorithm.advantage == "gae":
        raise UserError(
            f"config placement.mode={p.mode}: the Ray trainer group does not host a reference "
            "model or a critic yet; use placement.mode=single for KL (algorithm.kl.coef > 0) or "
            "PPO with a critic (algorithm.advantage=gae)"
        )
    if cfg.trainer.bf16_autocast:
        raise UserError(
            f"config placement.mode={p.mode}: trainer.bf16_autocast is not supported by the "
            "FSDP2 trainer group yet; set it to false"
        )


def _check_algorithm(cfg: Config) -> None:
    a = cfg.algorithm
    if a.advantage in GROUP_BASELINES and cfg.rollout.n < 2:
        raise UserError(
            f"config rollout.n: algorithm.advantage={a.advantage} takes its baseline from the "
            f"samples of each prompt (its group) and needs rollout.n >= 2 (got {cfg.rollout.n}); "
            "with one sample per prompt use reinforce_pp, remax or gae"
        )
    for key, value in (
        ("algorithm.is_threshold", a.is_threshold),
        ("algorithm.critic.lr", a.critic.lr),
        ("rollout.temperature", cfg.rollout.temperature),
        ("dpo.beta", cfg.dpo.beta),
        ("dpo.lr", cfg.dpo.lr),
    ):
        if not math.isfinite(value):
            raise UserError(f"config {key}: must be a finite number, got {value}")
    if a.kl.coef > 0 and a.kl.placement == "loss" and a.kl.estimator == "k1":
        raise UserError(
            "config algorithm.kl.estimator: k1 as a loss term has zero expected gradient (its "
            "gradient is the score function); use k2 or k3 as a loss, or "
            "algorithm.kl.placement=reward for k1"
        )
    if a.dynamic_sampling and a.advantage not in GROUP_BASELINES:
        raise UserError(
            f"config algorithm.dynamic_sampling: drops groups whose rewards are all equal, which "
            f"only carry no signal under a group baseline ({', '.join(sorted(GROUP_BASELINES))}); "
            f"algorithm.advantage={a.advantage} still learns from them"
        )
    if 0 < a.dual_clip <= 1:
        raise UserError("config algorithm.dual_clip: must be above 1 (or 0 for off)")
    if a.gamma > 1 or a.lam > 1:
        raise UserError("config algorithm.gamma / algorithm.lam: must be in [0, 1]")
    if a.overlong_cache > cfg.rollout.max_tokens:
        raise UserError(
            f"config algorithm.overlong_cache: must be at most rollout.max_tokens "
            f"({cfg.rollout.max_tokens}), got {a.overlong_cache}"
        )
    if a.is_threshold <= 1:
        raise UserError("config algorithm.is_threshold: must be above 1")
    if not a.critic.lr > 0:
        raise UserError("config algorithm.critic.lr: must be positive")
