"""Pack flat samples into padding-free micro-batches under a token budget.

Sequences of one micro-batch are concatenated into a single row ``[1, N]``; ``position_ids``
restart at 0 for each sequence, from which transformers builds a block-diagonal causal mask, so
no token attends across sequences and no padding token is ever computed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treadle.types import TrainSample


@dataclass
class MicroBatch:
    """Packed tensors of some samples; ``N`` is the total number of their tokens."""

    sample_index: list[int]
    """Which samples of the step are packed here, in order."""
    seq_lens: list[int]
    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N]
    loss_mask: torch.Tensor  # [N] bool
    behavior_logprobs: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    ref_logprobs: torch.Tensor | None  # [N], None without a reference model
    old_logprobs: torch.Tensor | None  # [N], None unless the trainer recomputed them
    values: torch.Tensor | None  # [N] critic values before the update, None without a critic
    returns: torch.Tensor | None  # [N] value targets, None without a critic

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with its tensors on ``device``."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return dataclasses.replace(
            self,
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            loss_mask=move(self.loss_mask),
            behavior_logprobs=move(self.behavior_logprobs),
            advantages=move(self.advantages),
            ref_logprobs=move(self.ref_logprobs),
            old_logprobs=move(self.old_logprobs),
            values=move(self.values),
            returns=move(self.returns),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def segments(self) -> torch.Tensor:
        """``[N]`` index (0 .. S-1) of the packed sample each token belongs to."""
        lens = torch.tensor(self.seq_lens, device=self.input_ids.device)
        return torch.repeat_interleave(torch.arange(len(self.seq_lens), device=lens.device), lens)


@dataclass
class TokenOutputs:
    """What a forward pass over a micro-batch yields per token ``[N]``; a policy fills
    ``logprobs`` and ``entropy``, a critic fills ``values``."""

    logprobs: torch.Tensor | None  # [N] logprob (nats) of each token given its prefix
    entropy: torch.Tensor | None  # [N] entropy (nats) of the distribution that token came from
    values: torch.Tensor | None  # [N] critic value of the state before each token


def plan_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing bins of sample indices, each at most ``budget`` tokens.

    A sample longer than the budget gets a bin of its own. Returns bins in a stable order.
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def pack(samples: Sequence[TrainSample], index: list[int]) -> MicroBatch:
    """Concatenate ``samples[i] for i in index`` into one padding-free row."""
    chosen = [samples[i] for i in index]
    cat = lambda xs, dtype: torch.tensor([v for s in chosen for v in xs(s)], dtype=dtype)  # noqa: E731

    def optional(xs):  # a per-token array that every chosen sample carries, else None
        return cat(xs, torch.float32) if all(xs(s) for s in chosen) else None

    return MicroBatch(
        sample_index=list(index),
        seq_lens=[len(s) for s in chosen],
        input_ids=cat(lambda s: s.token_ids, torch.long)[None],
        position_ids=torch.cat([torch.arange(len(s)) for s in chosen])[None],
        loss_mask=cat(lambda s: s.loss_mask, torch.bool),
        behavior_logprobs=cat(lambda s: s.behavior_logprobs, torch.float32),
        advantages=cat(lambda s: s.advantages, torch.float32),
        ref_logprobs=optional(lambda s: s.ref_logprobs),
        old_logprobs=optional(lambda s: s.old_logprobs),
        values=optional(lambda s: s.values),
        returns=optional(lambda s: s.returns),
    )


def unpack(values: torch.Tensor, seq_lens: Sequence[int]) -> list[list[float]]:
    """Split a flat ``[N]`` tensor back into per-sample lists."""
    return [chunk.tolist() for chunk in torch.split(values.detach().float().cpu(), list(seq_lens))]
