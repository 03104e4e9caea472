"""treadle's value of a conformance row: its inputs run through the code a training run uses.

One function per row ``kind``, ``(inputs, options) -> list[float]``: ``options`` are dotted
config overrides (``{"algorithm.loss_agg": "token-sum-norm"}``), built into a real config by
:func:`treadle.config.load_config`, so an option the table names is one a user can set (and its
checks run). Per-token results are listed at the trained tokens only, row by row.

The losses go through :class:`~treadle.train.objectives.PolicyObjective` on samples packed by
:func:`~treadle.train.packing.pack`, and a ``mis_denominator=kept`` row through the loop's
:func:`~treadle.rollout.samples.drop_rejected`, so the suite checks what a run computes, not a
copy of it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from treadle.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInput,
    AdvantageParams,
)
from treadle.algorithms.aggregation import AGGREGATIONS
from treadle.algorithms.correction import off_policy_sequence_mask
from treadle.algorithms.losses import KL_ESTIMATORS
from treadle.config import AlgorithmConfig, load_config
from treadle.core.batch import StepTotals, TokenOutputs
from treadle.core.types import TrainSample
from treadle.rollout.samples import drop_rejected
from treadle.train.objectives import PolicyObjective
from treadle.train.packing import pack

Inputs = dict
Options = dict[str, object]


def algorithm(options: Options) -> AlgorithmConfig:
    """The ``algorithm`` section with ``options`` applied over the defaults (validated)."""
    overrides = [f"{key}={value}" for key, value in options.items()]
    return load_config(None, overrides).algorithm


def _t(x, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


def _trained(x: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return [float(v) for v in x[mask.bool()]]


def _advantages(inputs: Inputs, options: Options) -> tuple[torch.Tensor, torch.Tensor | None]:
    cfg = algorithm(options)
    mask = _t(inputs["mask"], torch.bool)
    batch = AdvantageInput(
        rewards=_t(inputs["rewards"]),
        mask=mask,
        groups=_t(inputs["groups"], torch.long),
        token_rewards=_t(inputs["token_rewards"]) if "token_rewards" in inputs else None,
        values=_t(inputs["values"]) if "values" in inputs else None,
        baselines=_t(inputs["baselines"]) if "baselines" in inputs else None,
    )
    params = AdvantageParams(
        gamma=inputs.get("gamma", cfg.gamma),
        lam=inputs.get("lam", cfg.lam),
        credit=cfg.token_reward_credit,
    )
    out, _ = ADVANTAGE_ESTIMATORS[cfg.advantage](batch, params)
    return out.advantages, out.returns


def advantage(inputs: Inputs, options: Options) -> list[float]:
    """Advantages ``[B, T]`` of ``algorithm.advantage`` at the trained tokens."""
    return _trained(_advantages(inputs, options)[0], _t(inputs["mask"]))


def returns(inputs: Inputs, options: Options) -> list[float]:
    """Value targets ``[B, T]`` (GAE) at the trained tokens."""
    return _trained(_advantages(inputs, options)[1], _t(inputs["mask"]))


def _samples(inputs: Inputs, advantages, old=None, behavior=None) -> list[TrainSample]:
    """One sample per row of ``inputs["mask"]`` (its full width; untrained tokens masked)."""
    mask = inputs["mask"]
    zeros = [[0.0] * len(m) for m in mask]
    behavior = behavior if behavior is not None else old if old is not None else zeros
    return [
        TrainSample(
            token_ids=list(range(1, len(m) + 1)),
            loss_mask=[bool(x) for x in m],
            behavior_logprobs=list(behavior[b]),
            advantages=list(advantages[b]),
            policy_version=0,
            group_id=f"g{b}",  # no shared prefix: token i of the row is position i of sample b
            old_logprobs=list(old[b]) if old is not None else [],
        )
        for b, m in enumerate(mask)
    ]


def _objective_loss(cfg, samples, logprobs, entropy=None, max_tokens=8) -> float:
    """The step's loss of ``samples`` under ``cfg`` (one micro-batch holds the whole step)."""
    batch = pack(samples, list(range(len(samples))))
    totals = StepTotals(
        tokens=sum(sum(s.loss_mask) for s in samples),
        sequences=sum(any(s.loss_mask) for s in samples),
    )
    flat = torch.tensor([v for row in logprobs for v in row])
    ent = torch.tensor([v for row in entropy for v in row]) if entropy else torch.zeros_like(flat)
    objective = PolicyObjective.from_config(cfg, max_tokens=max_tokens)
    loss, _ = objective(TokenOutputs(flat, ent, None), batch, totals)
    return float(loss)


def policy_loss(inputs: Inputs, options: Options) -> list[float]:
    """The step's policy loss (clipped surrogate, aggregated) on the given logprobs."""
    cfg = algorithm(options)
    samples = _samples(inputs, inputs["advantages"], behavior=inputs["old_logprobs"])
    return [_objective_loss(cfg, samples, inputs["logprobs"])]


def aggregation(inputs: Inputs, options: Options) -> list[float]:
    """``algorithm.loss_agg`` of a per-token loss ``[B, T]`` (``C`` = ``inputs["C"]``)."""
    cfg = algorithm(options)
    mask = _t(inputs["mask"], torch.bool)
    totals = StepTotals(int(mask.sum()), int(mask.any(-1).sum()), float(inputs["C"]))
    segments = torch.arange(mask.shape[0]).repeat_interleave(mask.shape[1])
    agg = AGGREGATIONS[cfg.loss_agg]
    return [float(agg(_t(inputs["loss"]).flatten(), mask.flatten(), segments, totals))]


def kl(inputs: Inputs, options: Options) -> list[float]:
    """``algorithm.kl.estimator`` per token."""
    cfg = algorithm(options)
    out = KL_ESTIMATORS[cfg.kl.estimator](_t(inputs["logprobs"]), _t(inputs["ref_logprobs"]))
    return [float(v) for v in out]


def importance_sampling(inputs: Inputs, options: Options) -> list[float]:
    """The step's loss when each trained token's own loss is ``inputs["loss"]`` (PPO at ratio 1
    with advantage ``-loss``), weighted by ``algorithm.importance_sampling`` at ``C``."""
    cfg = algorithm(options | {"algorithm.is_threshold": inputs["C"]})
    negated = [[-x for x in row] for row in inputs["loss"]]
    old = inputs["old_logprobs"]
    samples = _samples(inputs, negated, old=old, behavior=inputs["behavior_logprobs"])
    drop_rejected(samples, cfg)  # what the loop does after recomputing the old logprobs
    return [_objective_loss(cfg, samples, old)]


def entropy(inputs: Inputs, options: Options) -> list[float]:
    """The entropy bonus that the step's loss subtracts, at ``algorithm.entropy_coef``."""
    cfg = algorithm(options | {"algorithm.entropy_coef": inputs["coef"]})
    mask = inputs["mask"]
    zeros = [[0.0] * len(m) for m in mask]
    samples = _samples(inputs, zeros)
    return [-_objective_loss(cfg, samples, zeros, inputs["entropy"], max_tokens=inputs["C"])]


def off_policy_mask(inputs: Inputs, options: Options) -> list[float]:
    """The off-policy sequence keep-mask at the trained tokens (all 1 when the option is off)."""
    cfg = algorithm(options)
    mask = _t(inputs["mask"], torch.bool)
    if cfg.off_policy_mask == 0:
        return _trained(torch.ones(mask.shape), mask)
    segments = torch.arange(mask.shape[0]).repeat_interleave(mask.shape[1])
    adv = _t(inputs["advantages"])[:, None].expand(mask.shape)
    keep, _ = off_policy_sequence_mask(
        _t(inputs["logprobs"]).flatten(),
        _t(inputs["behavior_logprobs"]).flatten(),
        adv.flatten(),
        mask.flatten(),
        segments,
        cfg.off_policy_mask,
    )
    return _trained(keep.view(mask.shape), mask)


KINDS: dict[str, Callable[[Inputs, Options], list[float]]] = {
    "advantage": advantage,
    "returns": returns,
    "policy_loss": policy_loss,
    "aggregation": aggregation,
    "kl": kl,
    "importance_sampling": importance_sampling,
    "entropy": entropy,
    "off_policy_mask": off_policy_mask,
}
"""Row ``kind`` -> treadle's value of that row."""
