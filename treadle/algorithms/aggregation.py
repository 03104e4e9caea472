"""Loss aggregation: per-token losses of one micro-batch -> its share of the step's scalar loss.

One signature: ``(per_token [N], mask [N], segments [N], totals) -> scalar``. Every denominator
is counted over the whole optimizer step (``StepTotals``), so accumulating the micro-batches'
shares gives exactly the loss of the step's batch computed at once, whatever the packing (a
mean of micro-batch means would weight tokens by how they happened to be packed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from treadle.algorithms.losses import segment_sum
from treadle.core.batch import StepTotals

Aggregation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, StepTotals], torch.Tensor]


def _masked(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token losses with masked-out positions set to 0 (a nan or inf there cannot leak)."""
    return torch.where(mask, per_token, torch.zeros_like(per_token))


def token_mean(per_token, mask, segments, totals: StepTotals) -> torch.Tensor:
    """``sum_{i,t} m l / sum_{i,t} m``: every token weighs the same (DAPO, arXiv:2503.14476,
    eq. 12; the default of verl and of TRL's ``loss_type="dapo"``)."""
    return _masked(per_token, mask).sum() / max(totals.tokens, 1)


def seq_mean_token_mean(per_token, mask, segments, totals: StepTotals) -> torch.Tensor:
    """``mean_i (sum_t m l / |y_i|)``: every sample weighs the same, its tokens share it (the
    GRPO paper's eq. 3, arXiv:2402.03300; GSPO; OpenRLHF's and TRL's original GRPO default)."""
    m = mask.to(per_token.dtype)
    per_seq = segment_sum(_masked(per_token, mask), segments) / segment_sum(m, segments).clamp(
        min=1
    )
    return per_seq.sum() / max(totals.sequences, 1)


def seq_mean_token_sum(per_token, mask, segments, totals: StepTotals) -> torch.Tensor:
    """``mean_i sum_t m l``: each sample's token losses summed, averaged over samples
    (the plain REINFORCE sequence objective; verl's ``seq-mean-token-sum``)."""
    return _masked(per_token, mask).sum() / max(totals.sequences, 1)


def seq_mean_token_sum_norm(per_token, mask, segments, totals: StepTotals) -> torch.Tensor:
    """``sum_{i,t} m l / (num_samples * C)`` with a constant ``C`` (the generation budget):
    Dr. GRPO's unbiased aggregation (arXiv:2503.20783, section 3.2; TRL's
    ``loss_type="dr_grpo"``). verl's mode of the same name does not divide by the number of
    samples: that is :func:`token_sum_norm`."""
    return _masked(per_token, mask).sum() / (max(totals.sequences, 1) * totals.constant)


def token_sum_norm(per_token, mask, segments, totals: StepTotals) -> torch.Tensor:
    """``sum_{i,t} m l / C``: verl's ``seq-mean-token-sum-norm`` as its ``agg_loss`` computes
    it (the step's token sum over the constant ``C`` alone, not also over the number of
    samples), so its value is ``num_samples`` times :func:`seq_mean_token_sum_norm`'s. verl's
    trainers scale each micro-batch's share further (by their gradient-accumulation or
    data-parallel factor); this is the aggregation itself, as ``agg_loss`` returns it."""
    return _masked(per_token, mask).sum() / totals.constant


AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
    "token-sum-norm": token_sum_norm,
}
"""``algorithm.loss_agg`` names; every member has the :data:`Aggregation` signature."""
