"""Other frameworks' names for treadle's config keys, for the "did you mean" of an unknown key.

A user coming from TRL (``GRPOConfig``, ``TrainingArguments``) or verl (its Hydra tree) writes
the names they know: ``trainer.learning_rate=1e-5``, ``num_generations: 16``,
``actor_rollout_ref.actor.optim.lr``. :func:`lookup` maps such a name to treadle's key; an
alias is only ever a suggestion in the error message, never read as the key itself (a recipe
keeps one spelling per setting). Every target is a real key (``tests/config/test_aliases.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Alias:
    """Where another framework's name for a setting lives in treadle."""

    key: str | None
    """treadle's dotted key, e.g. ``trainer.lr``; None where treadle has no such setting (the
    note says what it does instead)."""
    origin: str
    """Whose name it is: ``TRL``, ``verl``, or ``TRL and verl``."""
    note: str = ""
    """How the meaning differs, when it does (shown after the suggestion)."""


_TRL, _VERL, _BOTH = "TRL", "verl", "TRL and verl"

_PROMPTS = (
    "TRL counts completions per device: prompts_per_step = the batch of completions / rollout.n"
)
_NO_PROMPT_CUT = (
    "treadle cuts no prompt: one longer than the model's context less rollout.max_tokens is "
    "refused at start-up"
)
_EPOCHS = (
    "treadle trains each sample once per RL step; more optimizer steps per RL step come from "
    "splitting the batch"
)

ALIASES: dict[str, Alias] = {
    # Bare names match at any depth (``trainer.learning_rate``, ``learning_rate``); dotted ones
    # (verl's paths) match the whole path.
    "learning_rate": Alias("trainer.lr", _TRL),
    "num_generations": Alias("rollout.n", _TRL),
    "beta": Alias("algorithm.kl.coef", _TRL),
    "kl_coef": Alias("algorithm.kl.coef", _VERL),
    "kl_loss_coef": Alias("algorithm.kl.coef", _VERL),
    "kl_loss_type": Alias("algorithm.kl.estimator", _VERL),
    "kl_penalty": Alias("algorithm.kl.estimator", _VERL),
    "ppo_epochs": Alias("trainer.mini_batches", _VERL, _EPOCHS),
    "num_iterations": Alias("trainer.mini_batches", _TRL, _EPOCHS),
    "ppo_mini_batch_size": Alias(
        "trainer.mini_batches", _VERL, "treadle counts them: mini_batches = batch / mini-batch size"
    ),
    "max_completion_length": Alias("rollout.max_tokens", _TRL),
    "max_new_tokens": Alias("rollout.max_tokens", "transformers"),
    "response_length": Alias("rollout.max_tokens", _VERL),
    "max_response_length": Alias("rollout.max_tokens", _VERL),
    "max_prompt_length": Alias(None, _BOTH, _NO_PROMPT_CUT),
    "per_device_train_batch_size": Alias("rollout.prompts_per_step", _TRL, _PROMPTS),
    "train_batch_size": Alias("rollout.prompts_per_step", _VERL),
    "epsilon": Alias("algorithm.clip_eps_low", _TRL),
    "epsilon_high": Alias("algorithm.clip_eps_high", _TRL),
    "clip_ratio": Alias("algorithm.clip_eps_low", _VERL, "set algorithm.clip_eps_high too"),
    "clip_ratio_low": Alias("algorithm.clip_eps_low", _VERL),
    "clip_ratio_high": Alias("algorithm.clip_eps_high", _VERL),
    "clip_ratio_c": Alias("algorithm.dual_clip", _VERL),
    "temperature": Alias("rollout.temperature", _BOTH),
    "lr_scheduler_type": Alias("trainer.lr_schedule", _TRL),
    "warmup_style": Alias("trainer.lr_schedule", _VERL),
    "warmup_steps": Alias("trainer.warmup_steps", _TRL),
    "lr_warmup_steps": Alias("trainer.warmup_steps", _VERL),
    "max_grad_norm": Alias("trainer.grad_clip", _TRL),
    "adam_beta1": Alias("trainer.betas", _TRL, "treadle takes both: trainer.betas=[0.9, 0.99]"),
    "adam_beta2": Alias("trainer.betas", _TRL, "treadle takes both: trainer.betas=[0.9, 0.99]"),
    "seed": Alias("run.seed", _BOTH, "data.seed seeds the generated prompts"),
    "loss_type": Alias("algorithm.loss_agg", _TRL, "see ALGORITHMS.md for the matching values"),
    "loss_agg_mode": Alias("algorithm.loss_agg", _VERL),
    "adv_estimator": Alias("algorithm.advantage", _VERL),
    "entropy_coeff": Alias("algorithm.entropy_coef", _VERL),
    "num_train_epochs": Alias("run.steps", _TRL, "treadle counts RL steps, not epochs"),
    "max_steps": Alias("run.steps", _TRL),
    "total_training_steps": Alias("run.steps", _VERL),
    "total_epochs": Alias("run.steps", _VERL, "treadle counts RL steps, not epochs"),
    "save_steps": Alias("run.save_every", _TRL),
    "save_freq": Alias("run.save_every", _VERL),
    "save_total_limit": Alias("run.keep_last", _TRL),
    "eval_steps": Alias("eval.every", _TRL),
    "test_freq": Alias("eval.every", _VERL),
    "model_name_or_path": Alias("model.path", _TRL),
    "bf16": Alias("trainer.bf16_autocast", _TRL, "the weights stay fp32"),
    "torch_dtype": Alias(
        "trainer.bf16_autocast", _TRL, "the trainer keeps fp32 weights; the engine's: rollout.dtype"
    ),
    "gradient_checkpointing": Alias("trainer.gradient_checkpointing", _TRL),
    "enable_gradient_checkpointing": Alias("trainer.gradient_checkpointing", _VERL),
    "gpu_memory_utilization": Alias("rollout.kv_cache_gib", _VERL, "treadle sizes it in GiB"),
    "vllm_gpu_memory_utilization": Alias("rollout.kv_cache_gib", _TRL, "treadle sizes it in GiB"),
    "mask_truncated_completions": Alias("algorithm.overlong_filter", _TRL),
    "use_dynamic_sampling": Alias("algorithm.dynamic_sampling", _VERL),
    "apply_chat_template_kwargs": Alias("data.chat_template_kwargs", _VERL),
    "prompt_key": Alias("data.question_field", _VERL),
    # verl's paths whose last part alone would be ambiguous (``lr``, ``n``, ``path``).
    "actor_rollout_ref.actor.optim.lr": Alias("trainer.lr", _VERL),
    "actor_rollout_ref.actor.optim.weight_decay": Alias("trainer.weight_decay", _VERL),
    "actor_rollout_ref.actor.grad_clip": Alias("trainer.grad_clip", _VERL),
    "actor_rollout_ref.rollout.n": Alias("rollout.n", _VERL),
    "actor_rollout_ref.rollout.name": Alias("rollout.engine", _VERL),
    "actor_rollout_ref.rollout.dtype": Alias("rollout.dtype", _VERL),
    "actor_rollout_ref.rollout.top_p": Alias("rollout.top_p", _VERL),
    "actor_rollout_ref.rollout.mode": Alias("rollout.mode", _VERL),
    "actor_rollout_ref.model.path": Alias("model.path", _VERL),
    "critic.optim.lr": Alias("algorithm.critic.lr", _VERL),
    "trainer.experiment_name": Alias("run.name", _VERL),
    "trainer.default_local_dir": Alias("run.output_dir", _VERL),
    "data.train_files": Alias("data.path", _VERL),
}
"""Other frameworks' name (bare, or a whole dotted path) -> treadle's key."""


def lookup(dotted: str) -> Alias | None:
    """The alias for the unknown key ``dotted``: its whole path first, then its last part
    (``trainer.learning_rate`` -> ``learning_rate``); None when neither is known."""
    for name in (dotted, dotted.rsplit(".", 1)[-1]):
        if name in ALIASES:
            return ALIASES[name]
    return None


def hint(dotted: str) -> str | None:
    """The "did you mean" text for the unknown key ``dotted`` from :data:`ALIASES`, e.g.
    ``did you mean trainer.lr? (learning_rate is TRL's name)``; None when it has no alias."""
    alias = lookup(dotted)
    if alias is None:
        return None
    name = dotted if dotted in ALIASES else dotted.rsplit(".", 1)[-1]
    note = f"; {alias.note}" if alias.note else ""
    if alias.key is None:
        return f"{name} is {alias.origin}'s name, treadle has no such setting{note}"
    return f"did you mean {alias.key}? ({name} is {alias.origin}'s name{note})"
