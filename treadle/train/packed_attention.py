"""Attention of a packed micro-batch computed per sequence, not over the whole packed row.

A packed micro-batch is one row ``[1, N]`` of several sequences. Given only ``position_ids``,
transformers builds an ``[N, N]`` block-diagonal causal mask and SDPA computes all ``N x N``
scores, most of them masked: attention costs grow with the square of the micro-batch size, not
of the sequence lengths (on the default task, 60 micro-batches of 512 tokens spent 32% of the
update in attention). Here the packed queries, keys and values are gathered into
``[S, H, T, D]`` (row ``s``: the positions of sample ``s``, a shared prefix included,
right-padded; rows come in chunks of similar length, each padded to its own longest ``T``;
:class:`~treadle.train.packing.MicroBatch` ``attn_gather``), attended with ``is_causal``
SDPA, and each position's output taken from the row that owns it (``attn_scatter``) back into
``[1, N, H, D]``: each sample attends only to itself, in about ``sum_s len_s^2`` instead of
``N^2`` work. Padding sits after each row's last token, so causal attention never lets a real
token see it; the padded outputs are dropped. Models that window their attention through the
mask alone (:func:`windowed`) are not given this layout.

Registered with transformers' ``AttentionInterface`` as ``"treadle_packed"`` and switched on
for the duration of one forward call by :func:`packed_attention`, so the model object keeps its
own attention everywhere else (generation, saving, a user's own calls).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

NAME = "treadle_packed"
# Keyword arguments decoder layers pass to attention that do not change its result here.
_HARMLESS = frozenset(
    {"position_ids", "use_cache", "output_attentions", "cache_position", "is_causal"}
)


class PackedAttentionUnavailable(RuntimeError):
    """The model did not pass the packed layout down to its attention layers (its forward does
    not forward keyword arguments), or uses sliding-window attention."""


def packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, N, D]
    key: torch.Tensor,  # [1, Hkv, N, D]
    value: torch.Tensor,  # [1, Hkv, N, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_gather: tuple[torch.Tensor, ...] | None = None,
    packed_scatter: torch.Tensor | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention of each packed sequence over itself; returns ``([1, N, H, D], None)``.

    Raises:
        PackedAttentionUnavailable: the layout kwargs did not arrive, or a sliding window is set.
    """
    if packed_gather is None or packed_scatter is None:
        raise PackedAttentionUnavailable("the packed layout did not reach the attention layer")
    if sliding_window is not None:
        raise PackedAttentionUnavailable("sliding-window attention is not supported")
    # Anything else that would change the scores (soft-capping, attention sinks, non-causal
    # layers) is refused, so a model this function does not cover falls back to its own.
    if kwargs.get("is_causal") is False:
        raise PackedAttentionUnavailable("non-causal attention is not supported")
    unknown = sorted(
        k for k, v in kwargs.items() if k not in _HARMLESS and v is not None and v is not False
    )
    if unknown:
        raise PackedAttentionUnavailable(f"attention arguments {unknown} are not supported")
    heads, dim = query.shape[1], query.shape[3]
    outs = []
    for gather in packed_gather:  # chunks of rows of similar length
        seqs, width = gather.shape
        flat = gather.reshape(-1)

        def padded(x: torch.Tensor, flat=flat, seqs=seqs, width=width) -> torch.Tensor:
            """This chunk's rows of ``x``: ``[1, h, N, D] -> [S, h, T, D]``."""
            # [1, h, N, D] -> [S, h, T, D]; index_select: its backward is an index_add, far
            # cheaper than indexing's index_put
            rows = x[0].transpose(0, 1).index_select(0, flat)  # [S * T, h, D]
            return rows.view(seqs, width, x.shape[1], dim).transpose(1, 2)

        q, k, v = padded(query), padded(key), padded(value)
        if k.shape[1] != heads:  # grouped-query attention: each kv head serves heads/Hkv queries
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, dropout_p=dropout if module.training else 0.0
        )  # [S, H, T, D]
        outs.append(out.transpose(1, 2).reshape(seqs * width, heads, dim))
    out = (outs[0] if len(outs) == 1 else torch.cat(outs)).index_select(0, packed_scatter)
    return out[None], None


AttentionInterface.register(NAME, packed_sdpa)


def windowed(config) -> bool:
    """Whether the model limits attention to a window or chunk through its mask alone (which
    :func:`packed_sdpa` does not apply): an active ``sliding_window``, ``attention_chunk_size``,
    or any layer type other than full attention."""
    configs = [config, *(getattr(config, k) for k in ("text_config",) if hasattr(config, k))]
    for c in configs:
        if getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True):
            return True
        if getattr(c, "attention_chunk_size", None):
            return True
        if any(t != "full_attention" for t in getattr(c, "layer_types", None) or ()):
            return True
    return False


@contextlib.contextmanager
def packed_attention(model: PreTrainedModel) -> Iterator[None]:
    """Within the block the model's attention is :func:`packed_sdpa` (pass a micro-batch's
    ``attn_gather`` and ``attn_scatter`` as ``packed_gather`` and ``packed_scatter``); restored
    on exit. The backward pass needs no switch: autograd replays the recorded operations."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
