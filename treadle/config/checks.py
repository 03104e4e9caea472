"""Checks of a built config that types alone cannot express.

One-field bounds are declared beside their fields (:mod:`treadle.config.fields`); the rules here
relate fields to each other, or to what the code downstream supports.
"""

from __future__ import annotations

import string
import typing

from treadle.config.algorithm import GROUP_BASELINES, AlgorithmConfig
from treadle.config.data import DataSource, SourceConfig
from treadle.config.fields import check_fields
from treadle.config.sections import Config, EngineName
from treadle.core.errors import UserError
from treadle.core.plugins import is_import_path


def check(cfg: Config) -> None:
    """Refuse a config that would fail later, or silently do something else than it says.

    Raises:
        UserError: naming the dotted key at fault and what was expected.
    """
    check_fields(cfg)
    _check_plugin_names(cfg)
    _check_placement(cfg)
    _check_rollout_mode(cfg)
    _check_engine(cfg)
    _check_environment(cfg)
    _check_model(cfg)
    _check_sources(cfg)
    _check_algorithm(cfg)
    _check_templates(cfg)
    _check_eval(cfg)
    _check_batch(cfg)
    _check_megatron(cfg)
    _check_lora(cfg)


def _check_plugin_names(cfg: Config) -> None:
    """A field that takes a built-in's name or an import path holds one of them (what the path
    names is imported and checked against its Protocol at start-up, not here)."""
    named = [("rollout.engine", cfg.rollout.engine, EngineName, "Class")]
    named += [
        (f"{key}.source", s.source, DataSource, "function")
        for key, s in (
            ("data", cfg.data),
            *((f"data.mix[{i}]", m) for i, m in enumerate(cfg.data.mix)),
        )
    ]
    for key, value, builtin, kind in named:
        choices = typing.get_args(builtin)
        if value not in choices and not is_import_path(value):
            raise UserError(
                f"config {key}: expected one of {', '.join(map(repr, choices))} or an import "
                f"path package.module:{kind} of your own, got {value!r}"
            )


def _check_placement(cfg: Config) -> None:
    """What the Ray trainer group and its engines support, and where an engine of its own
    process can run."""
    p = cfg.placement
    if cfg.rollout.engine_process == "own" and p.mode != "single":
        raise UserError(
            f"config rollout.engine_process=own: placement.mode={p.mode} runs every engine in a "
            "Ray worker process already; leave rollout.engine_process=auto"
        )
    if cfg.rollout.engine_process == "own" and cfg.rollout.tensor_parallel > 1:
        raise UserError(
            "config rollout.engine_process=own: vLLM's tensor-parallel ranks are worker "
            "processes of their own already; use rollout.engine_process=same with "
            "rollout.tensor_parallel > 1"
        )
    if p.mode == "single":
        return
    if p.mode == "colocated" and p.engines > p.trainers:
        raise UserError(
            f"config placement.engines: colocated puts each engine in a trainer's bundle, so at "
            f"most placement.trainers ({p.trainers}) engines, got {p.engines}"
        )


def _check_rollout_mode(cfg: Config) -> None:
    """What each rollout mode supports."""
    r = cfg.rollout
    if r.mode == "sync":
        for key, value in (
            ("partial", r.partial),
            ("oversample", r.oversample),
            ("max_running", r.max_running),
        ):
            if value:
                raise UserError(
                    f"config rollout.{key}: has no effect with rollout.mode=sync; set "
                    "rollout.mode=async (or one_step_off for oversample and max_running)"
                )
        return
    if r.mode == "one_step_off" and r.partial:
        raise UserError(
            "config rollout.partial: one_step_off finishes requests on the weights they started "
            "with; use rollout.mode=async with rollout.max_staleness=1 for partial rollouts"
        )
    if r.partial and r.stop:
        raise UserError(
            "config rollout.partial: a continued request sees the text sampled before the abort "
            "as prompt, so a stop string split at the abort would be missed; set rollout.stop=[] "
            "(the end-of-turn token still stops) or rollout.partial=false"
        )
    if cfg.algorithm.advantage == "remax":
        raise UserError(
            f"config rollout.mode={r.mode}: ReMax's greedy baseline is generated with the "
            "batch's policy; use rollout.mode=sync with algorithm.advantage=remax"
        )


def _check_engine(cfg: Config) -> None:
    """What the built-in engines support beyond the Protocol: single requests (SGLang's adapter
    serves batches only) and tensor parallelism (a plug-in engine reads
    ``spec.tensor_parallel`` itself)."""
    tp, engine = cfg.rollout.tensor_parallel, cfg.rollout.engine
    if engine == "sglang" and (cfg.rollout.mode != "sync" or cfg.environment.enabled):
        raise UserError(
            f"config rollout.engine=sglang: serves whole batches only, so rollout.mode=sync "
            "without an environment; use rollout.engine=vllm for rollout.mode="
            f"{cfg.rollout.mode} or environments"
        )
    if tp == 1:
        return
    if engine == "hf":
        raise UserError(
            f"config rollout.tensor_parallel={tp}: the hf engine runs one process; set "
            "rollout.engine=vllm (or sglang on GPUs) or rollout.tensor_parallel=1"
        )
    if cfg.placement.mode != "single":
        raise UserError(
            f"config rollout.tensor_parallel={tp}: Ray engine workers run one engine rank each "
            f"so far; use placement.mode=single (not {cfg.placement.mode}) or "
            "rollout.tensor_parallel=1"
        )


def _check_environment(cfg: Config) -> None:
    """What episodes support so far."""
    e = cfg.environment
    if not e.enabled:
        return
    if e.name and e.agent:
        raise UserError(
            f"config environment.agent={e.agent!r}: an outside agent is its own environment; "
            f"leave environment.name ({e.name!r}) empty"
        )
    if e.agent and e.kwargs:
        raise UserError(
            "config environment.kwargs: an outside agent (environment.agent) takes none; the "
            "agent function gets only its base_url and the task's messages"
        )
    for key, value in (("partial", cfg.rollout.partial), ("oversample", cfg.rollout.oversample)):
        if value:
            raise UserError(
                f"config rollout.{key}: episodes are generated a whole batch at a time, each by "
                "one policy version; leave it off with an environment (rollout.mode=async with "
                "max_staleness bounds how far they run ahead)"
            )
    if e.history != "as_sampled":
        raise UserError(
            f"config environment.history={e.history}: the training loop trains one sample per "
            "episode so far; use environment.history=as_sampled"
        )
    if cfg.algorithm.advantage == "remax":
        raise UserError(
            "config algorithm.advantage=remax: its greedy baseline is a single completion, not "
            "an episode; choose grpo, rloo or another group baseline with environment.name"
        )


def _check_model(cfg: Config) -> None:
    """Geometry of the built tiny model, which would otherwise fail deep inside torch or vLLM."""
    if cfg.model.path is not None:
        return
    t = cfg.model.tiny
    if t.num_attention_heads < 1 or t.hidden_size % t.num_attention_heads:
        raise UserError("config model.tiny.hidden_size: must be a multiple of num_attention_heads")
    if t.num_key_value_heads < 1 or t.num_attention_heads % t.num_key_value_heads:
        raise UserError("config model.tiny.num_key_value_heads: must divide num_attention_heads")
    # auto may resolve to vLLM (asynchronous modes, larger models)
    if cfg.rollout.engine in ("vllm", "auto") and t.hidden_size // t.num_attention_heads < 32:
        raise UserError(
            "config model.tiny.num_attention_heads: vLLM's CPU attention needs a head dim "
            "(hidden_size / num_attention_heads) of at least 32; or set rollout.engine=hf"
        )


def _check_sources(cfg: Config) -> None:
    """Every data source has its file, and the reward functions routed to it can score it."""
    if not cfg.reward.functions:
        raise UserError("config reward.functions: list at least one reward function")
    sources: list[tuple[str, SourceConfig]] = [("data", cfg.data)]
    sources += [(f"data.mix[{i}]", m) for i, m in enumerate(cfg.data.mix)]
    for key, s in sources:
        rg_functions = [
            f for f in cfg.reward.functions if f.name == "reasoning_gym" and f.scores(s.domain)
        ]
        if s.source != "reasoning_gym" and rg_functions:
            raise UserError(
                f"config reward.functions: reasoning_gym scores only reasoning_gym tasks, but it "
                f"is routed to {key}'s domain {s.domain!r} ({s.source}); use math_verify for file "
                "data (e.g. reward.functions='[{name: math_verify}]'), or give it domains"
            )
        if s.source != "reasoning_gym" and not s.path and not is_import_path(s.source):
            raise UserError(f"config {key}.path: required for source={s.source}")
        if s.answer_pattern and s.answer_extract != "none":
            raise UserError(
                f"config {key}.answer_extract={s.answer_extract}: {key}.answer_pattern is set "
                "too; keep one way of taking the gold answer out"
            )
    if cfg.data.reasoning != "none" and cfg.data.source != "reasoning_gym":
        raise UserError("config data.reasoning: chain_steps needs data.source=reasoning_gym")


def _check_algorithm(cfg: Config) -> None:
    """Settings of the algorithm that contradict each other or the rollout."""
    a = cfg.algorithm
    if a.advantage in GROUP_BASELINES and cfg.rollout.n < 2:
        raise UserError(
            f"config rollout.n: algorithm.advantage={a.advantage} takes its baseline from the "
            f"samples of each prompt (its group) and needs rollout.n >= 2 (got {cfg.rollout.n}); "
            "with one sample per prompt use reinforce_pp, remax or gae"
        )
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
    if a.overlong_cache > cfg.rollout.max_tokens:
        raise UserError(
            f"config algorithm.overlong_cache: must be at most rollout.max_tokens "
            f"({cfg.rollout.max_tokens}), got {a.overlong_cache}"
        )
    _check_peer_options(a)


def _check_peer_options(a: AlgorithmConfig) -> None:
    """The options that reproduce a peer framework's form apply to some settings only; set
    elsewhere they would silently do nothing."""
    credited = ("reinforce_pp_baseline", "remax")
    if a.token_reward_credit != "auto" and a.advantage not in credited:
        raise UserError(
            f"config algorithm.token_reward_credit={a.token_reward_credit}: only "
            f"{' and '.join(credited)} have two forms; algorithm.advantage={a.advantage} has "
            "one (leave it auto)"
        )
    rejecting = ("mis_token", "mis_seq", "decoupled")
    if a.mis_denominator == "kept" and a.importance_sampling not in rejecting:
        raise UserError(
            f"config algorithm.mis_denominator=kept: only {', '.join(rejecting)} drop tokens; "
            f"algorithm.importance_sampling={a.importance_sampling} drops none (leave it all)"
        )


def _check_templates(cfg: Config) -> None:
    """Demonstration templates name only the fields a demonstration fills in."""
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


def _check_eval(cfg: Config) -> None:
    """Evaluation settings that would measure nothing, or fail after the samples are drawn."""
    e = cfg.eval
    for i, k in enumerate(e.k):
        if k < 1:
            raise UserError(f"config eval.k[{i}]: pass@k needs k >= 1, got {k}")
        if k > e.samples_per_prompt:
            raise UserError(
                f"config eval.k[{i}]={k}: pass@{k} needs at least {k} samples per prompt, but "
                f"eval.samples_per_prompt={e.samples_per_prompt}; set eval.samples_per_prompt={k} "
                "or drop it"
            )
    if e.temperature is not None and not (e.temperature > 0 and e.temperature < float("inf")):
        raise UserError(
            f"config eval.temperature: must be positive and finite, got {e.temperature} (greedy "
            "decoding is measured by eval.greedy=true; null samples at rollout.temperature)"
        )


def _check_batch(cfg: Config) -> None:
    """A step's batch must fill every optimizer step it is split into."""
    samples = cfg.rollout.prompts_per_step * cfg.rollout.n
    if cfg.trainer.mini_batches > samples:
        raise UserError(
            f"config trainer.mini_batches={cfg.trainer.mini_batches}: a step's batch holds "
            f"{samples} samples (rollout.prompts_per_step x rollout.n), so some optimizer steps "
            f"would get none; set trainer.mini_batches to {samples} or less"
        )


def _check_megatron(cfg: Config) -> None:
    """What the megatron-core backend runs: tensor parallel 1 in one process, or over the Ray
    trainer group's ranks (tensor parallel = ``placement.trainers``, no data parallelism); a
    policy and a reference, no critic, no pipeline parallelism."""
    if cfg.trainer.backend != "megatron":
        return
    m = cfg.trainer.megatron
    if m.pipeline_parallel != 1:
        raise UserError(
            f"config trainer.megatron.pipeline_parallel={m.pipeline_parallel}: pipeline "
            "parallelism is not implemented; use trainer.megatron.pipeline_parallel=1"
        )
    ranks = 1 if cfg.placement.mode == "single" else cfg.placement.trainers
    if m.tensor_parallel != ranks:
        fix = (
            "placement.mode=disaggregated (or colocated) with placement.trainers="
            f"{m.tensor_parallel}"
            if cfg.placement.mode == "single"
            else f"trainer.megatron.tensor_parallel={ranks}"
        )
        raise UserError(
            f"config trainer.megatron.tensor_parallel={m.tensor_parallel}: the trainer ranks "
            f"are one tensor-parallel group ({ranks} rank(s) with placement.mode="
            f"{cfg.placement.mode}; data parallelism over Megatron ranks is not implemented); "
            f"use {fix}"
        )
    if cfg.trainer.gradient_checkpointing:
        raise UserError(
            "config trainer.gradient_checkpointing=true: not wired to megatron-core's "
            "activation recomputation yet; set it to false with trainer.backend=megatron"
        )
    if cfg.algorithm.advantage == "gae":
        raise UserError(
            "config trainer.backend=megatron: a critic (algorithm.advantage=gae) is not "
            "implemented; use trainer.backend=torch"
        )


def _check_lora(cfg: Config) -> None:
    """LoRA's settings the config alone can refuse (the target modules are checked against the
    model when it is wrapped, :func:`treadle.train.lora.apply_lora`)."""
    lora = cfg.model.lora
    if lora.r == 0:
        return
    if isinstance(lora.target_modules, str) and lora.target_modules != "all-linear":
        raise UserError(
            f"config model.lora.target_modules={lora.target_modules!r}: a list of module names "
            "or 'all-linear'"
        )
    if not lora.target_modules:
        raise UserError("config model.lora.target_modules: name at least one linear module")
    if cfg.trainer.backend == "megatron":
        raise UserError(
            f"config model.lora.r={lora.r}: LoRA runs on trainer.backend=torch or deepspeed, "
            "not megatron; set model.lora.r=0 or another trainer.backend"
        )
    if cfg.trainer.backend == "deepspeed" and cfg.trainer.deepspeed.zero_stage == 3:
        raise UserError(
            f"config model.lora.r={lora.r}: LoRA under ZeRO-3 (trainer.deepspeed.zero_stage=3) "
            "is not supported yet (the adapter sync and export read unpartitioned weights); use "
            "trainer.deepspeed.zero_stage=1 or 2"
        )
    if lora.sync == "adapter" and cfg.rollout.engine not in ("vllm", "auto"):  # auto: vllm
        raise UserError(
            f"config model.lora.sync=adapter: only rollout.engine=vllm serves adapters (got "
            f"{cfg.rollout.engine}); use model.lora.sync=merged"
        )
    if cfg.placement.mode != "single":
        raise UserError(
            f"config model.lora.r={lora.r}: LoRA runs with placement.mode=single only (got "
            f"{cfg.placement.mode}); set placement.mode=single or model.lora.r=0"
        )
