"""What a training backend computes over and hands its objective: a packed micro-batch of flat
samples (:class:`MicroBatch`), the per-token outputs of a forward pass over it
(:class:`TokenOutputs`) and the optimizer step's loss denominators (:class:`StepTotals`).

Built by :func:`treadle.train.packing.pack`; the layout is explained there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepTotals:
    """Counts over all micro-batches of one optimizer step."""

    tokens: int
    """Trained (masked-in) tokens."""
    sequences: int
    """Samples with at least one trained token (a fully masked sample is not counted)."""
    constant: float = 1.0
    """Normaliser of ``seq-mean-token-sum-norm`` in tokens (the generation budget,
    ``rollout.max_tokens``); the objective that uses it sets it."""


@dataclass
class MicroBatch:
    """Packed tensors of some samples; ``N`` is the number of tokens computed (a shared prefix
    counts once)."""

    sample_index: list[int]
    """Which samples of the step are packed here, in order."""
    seq_lens: list[int]
    """Full length of each sample (its shared prefix included)."""
    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N]
    prev: torch.Tensor  # [N] long: position of the token before each token in its sample, -1 first
    sample_tokens: torch.Tensor  # [sum(seq_lens)] long: each sample's token positions, in order
    attn_gather: tuple[torch.Tensor, ...]
    """Attention rows in chunks of similar length: chunk ``c`` is ``[S_c, T_c]`` long, each row
    one sample's positions (its shared prefix included), right-padded with 0."""
    attn_scatter: torch.Tensor  # [N] long: index into the chunks' concatenated [S_c * T_c] outputs
    loss_mask: torch.Tensor  # [N] bool
    behavior_logprobs: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    segments: torch.Tensor
    """``[N]`` long: index (0 .. S-1) of the packed sample each token belongs to (a shared
    prefix's tokens count for the group's first sample; they are never trained on)."""
    ref_logprobs: torch.Tensor | None  # [N], None without a reference model
    old_logprobs: torch.Tensor | None  # [N], None unless the trainer recomputed them
    values: torch.Tensor | None  # [N] critic values before the update, None without a critic
    returns: torch.Tensor | None  # [N] value targets, None without a critic

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with its tensors on ``device``."""

        def move(t):
            """``t`` (a tensor, a tuple of tensors, or None) on ``device``."""
            if isinstance(t, tuple):
                return tuple(x.to(device, non_blocking=True) for x in t)
            return None if t is None else t.to(device, non_blocking=True)

        return dataclasses.replace(
            self,
            **{
                f.name: move(getattr(self, f.name))
                for f in dataclasses.fields(self)
                if f.name not in ("sample_index", "seq_lens")
            },
        )

    @property
    def num_tokens(self) -> int:
        """``N``: positions computed in this micro-batch (tokens; a shared prefix counts once)."""
        return int(self.input_ids.shape[1])

    @property
    def shared(self) -> bool:
        """Whether some positions serve several samples (a shared prefix)."""
        return sum(self.seq_lens) != self.num_tokens

    def per_sample(self, values: torch.Tensor) -> list[list[float]]:
        """Per-sample lists ``[L]`` of a per-token tensor ``[N]`` (shared positions repeated
        into every sample that holds them)."""
        flat = values.detach().float().cpu()[self.sample_tokens.cpu()]
        return [chunk.tolist() for chunk in torch.split(flat, list(self.seq_lens))]


@dataclass
class TokenOutputs:
    """What a forward pass over a micro-batch yields per token ``[N]``; a policy fills
    ``logprobs`` and ``entropy``, a critic fills ``values``."""

    logprobs: torch.Tensor | None  # [N] logprob (nats) of each token given its prefix
    entropy: torch.Tensor | None  # [N] entropy (nats) of the distribution that token came from
    values: torch.Tensor | None  # [N] critic value of the state before each token
