"""The ``algorithm`` section: advantage estimator, policy loss, KL to a reference, critic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from treadle.config.fields import (
    above,
    at_least,
    at_most,
    below,
    bounded,
    finite,
    off_or_above,
    positive,
)

GROUP_BASELINES = frozenset({"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"})
"""Advantage estimators whose baseline is the other samples of the prompt (its group): they need
``rollout.n >= 2``, and only they lose all signal on a group whose rewards are equal."""


@dataclass
class KLConfig:
    """KL to a frozen reference (the starting policy). ``coef`` 0 loads no reference model."""

    coef: float = bounded(at_least(0.0), default=0.0)
    """Weight of the KL term (TRL's ``beta``, verl's ``kl_loss_coef``); 0: no KL and no
    reference model."""
    estimator: Literal["k1", "k2", "k3", "low_var_k3"] = "k3"
    """Per-token estimator of KL(policy || reference); see ALGORITHMS.md for each one."""
    placement: Literal["loss", "reward"] = "loss"
    """Where the KL term enters. ``loss``: ``coef * KL`` added to each token's loss (GRPO).
    ``reward``: ``-coef * KL`` of
    the sampling policy added to each token's reward before advantages (InstructGPT PPO,
    REINFORCE++, RLOO)."""


@dataclass
class CriticConfig:
    """The value model of PPO (``algorithm.advantage=gae``): the policy's architecture and
    starting weights with a one-output value head instead of the LM head."""

    lr: float = bounded(finite(), positive(), default=1.0e-4)
    """Learning rate of the critic's AdamW optimizer."""
    value_clip: float = bounded(at_least(0.0), default=0.2)
    """Clip of the value change per update around the old value (0: unclipped)."""


@dataclass
class MismatchConfig:
    """An alarm on the engine/trainer mismatch the trainer measures each step before its update
    (``mismatch/*``, ALGORITHMS.md "Rollout/train mismatch"). A threshold of 0 is off.

    In ``rollout.mode`` ``one_step_off`` and ``async`` the engine's behaviour policy lags the
    trainer by design (up to ``rollout.max_staleness`` versions), and that lag counts in the
    mismatch too: the thresholds then bound the policy's change over the lag as well.
    """

    max_kl_k3: float = bounded(at_least(0.0), default=0.01)
    """Alarm when the step's ``mismatch/kl_k3`` (k3 estimate of KL(engine || trainer), nats per
    token) exceeds this. A healthy bf16 vLLM engine against an fp32 trainer sits near 1e-3."""
    max_abs_logprob_diff: float = bounded(at_least(0.0), default=10.0)
    """Alarm when the step's ``mismatch/max_abs_logprob_diff`` (the largest
    ``|logp_trainer - logp_engine|`` of a trained token, nats) exceeds this; one token of a
    large bf16 batch may reach a few nats, 10 nats is a factor of e^10 (~22,000) in probability."""
    action: Literal["warn", "stop"] = "warn"
    """What an alarm does. ``warn``: log a warning for each step that exceeds a threshold and
    count it in
    ``mismatch/alarms``. ``stop``: end the run with the message, after that step's metrics row
    is logged (``RUN/metrics.jsonl``)."""


@dataclass
class AlgorithmConfig:
    """The ``algorithm`` section: how rewards become advantages and advantages become a loss."""

    advantage: Literal[
        "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "gae"
    ] = "grpo"
    """Advantage estimator (``gae`` trains a critic; ``remax`` samples a greedy baseline)."""
    policy_loss: Literal["ppo", "gspo", "vanilla"] = "ppo"
    """``ppo``: clipped token ratio (DAPO's clip-higher when clip_eps_high > clip_eps_low);
    ``gspo``: clipped sequence ratio; ``vanilla``: unclipped policy gradient."""
    clip_eps_low: float = bounded(
        at_least(0.0), below(1, "the ratio floor is 1 - eps"), default=0.2
    )
    """Lower clip of the PPO ratio at ``1 - clip_eps_low`` (TRL's ``epsilon``, verl's
    ``clip_ratio_low``)."""
    clip_eps_high: float = bounded(at_least(0.0), default=0.2)
    """Upper clip of the PPO ratio at ``1 + clip_eps_high`` (DAPO's clip-higher uses 0.28)."""
    dual_clip: float = bounded(at_least(0.0), off_or_above(1), default=0.0)
    """Dual-clip bound c (> 1) on negative-advantage tokens' loss (verl uses 3); 0: off."""
    loss_agg: Literal[
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "token-sum-norm",
    ] = "token-mean"
    """How per-token losses become the step's loss (``-norm`` divides by rollout.max_tokens;
    ``token-sum-norm`` is verl's ``seq-mean-token-sum-norm``, see ALGORITHMS.md)."""
    kl: KLConfig = field(default_factory=KLConfig)
    entropy_coef: float = bounded(at_least(0.0), default=0.0)
    """Entropy bonus weight (the loss subtracts ``coef * entropy``); entropy is always logged."""
    entropy_agg: Literal["token-mean", "loss_agg"] = "token-mean"
    """How the entropy bonus is averaged. ``token-mean``: ``coef * mean token entropy`` whatever
    ``loss_agg`` is (as TRL). ``loss_agg``: aggregated like the policy loss (verl), so under
    ``seq-mean-token-sum`` the bonus grows with completion length."""
    token_reward_credit: Literal["auto", "sequence", "to_go"] = "auto"
    """How ``reinforce_pp_baseline`` and ``remax`` credit per-token rewards (a KL penalty in
    the reward). ``auto``: each paper's form (token reward-to-go for REINFORCE++-baseline, the
    sequence reward for ReMax); ``sequence`` / ``to_go`` pick one, verl's forms being
    ``sequence`` for REINFORCE++-baseline and ``to_go`` for ReMax."""
    gamma: float = bounded(at_least(0.0), at_most(1), default=1.0)
    """Per-token discount (GAE, REINFORCE++)."""
    lam: float = bounded(at_least(0.0), at_most(1), default=0.95)
    """GAE lambda."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal, sample more prompts to refill the batch."""
    max_sampling_rounds: int = bounded(at_least(1), default=3)
    """Dynamic sampling's cap on generation rounds per step; then the step trains on what it
    has (logged as ``filter/kept_groups``)."""
    overlong_filter: bool = False
    """DAPO: truncated completions (hit rollout.max_tokens) are not trained on."""
    overlong_cache: int = bounded(at_least(0), default=0)
    """DAPO soft overlong punishment: the last this-many tokens of rollout.max_tokens cost up to
    -1 reward, linearly (0: off)."""
    importance_sampling: Literal[
        "none", "tis_token", "tis_seq", "mis_token", "mis_seq", "decoupled"
    ] = "none"
    """Correction for the engine/trainer mismatch, and for stale samples in the asynchronous
    rollout modes (``decoupled``: AReaL's decoupled PPO, the ratio against the trainer's
    recomputed logprobs and each token weighted by their ratio to the behaviour policy's);
    anything but ``none`` recomputes the old logprobs with the trainer before the update."""
    is_threshold: float = bounded(finite(), above(1), default=2.0)
    """C of the correction: TIS truncates weights at C; MIS drops weights outside [1/C, C];
    ``decoupled`` drops weights above C."""
    mis_denominator: Literal["all", "kept"] = "all"
    """Where the tokens that ``mis_token``, ``mis_seq`` or ``decoupled`` drop are counted.
    ``all``: they stay in the aggregation's denominators with weight 0 (OpenRLHF's ICEPOP,
    TRL). ``kept``: they leave the loss mask before the update, and every denominator (verl's
    rollout rejection sampling); the ``mismatch/*`` metrics then cover the kept tokens only."""
    off_policy_mask: float = bounded(at_least(0.0), default=0.0)
    """Off-policy sequence masking (DeepSeek-V3.2, eq. 9; TRL's ``off_policy_mask_threshold``):
    a negative-advantage sample whose mean ``behaviour - current`` logprob exceeds this many nats
    per token adds no policy loss. 0: off."""
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    """The alarm on the engine/trainer mismatch (``mismatch/kl_k3``,
    ``mismatch/max_abs_logprob_diff``): warn or stop the run."""
    critic: CriticConfig = field(default_factory=CriticConfig)
