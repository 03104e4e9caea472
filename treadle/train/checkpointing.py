"""Gradient (activation) checkpointing of a Hugging Face model's decoder layers
(``trainer.gradient_checkpointing``).

Each decoder layer keeps only its input during the forward pass and recomputes its activations
when the backward pass reaches it (Chen et al. 2016, arXiv:1604.06174): activation memory goes
from ``layers x (what one layer saves)`` to ``layers x (one hidden state [N, d])`` plus one
layer's activations, for about one more forward pass of compute. torch's non-reentrant
checkpoint is used (it works with keyword arguments, FSDP2's hooks and frozen inputs).

The recomputation runs in the backward pass, outside the forward call that chose the attention
implementation (:func:`treadle.train.packed_attention.packed_attention` sets it only for the
forward's duration); a layer recomputed under the model's own attention would silently give
other activations, so each checkpoint restores, for its recomputation, the attention
implementation its forward ran with.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from transformers import PreTrainedModel

from treadle.core.errors import UserError


@contextlib.contextmanager
def _attention(config, implementation: str) -> Iterator[None]:
    """``config``'s attention implementation set to ``implementation`` within the block."""
    previous = config._attn_implementation
    config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = previous


def _contexts(config) -> tuple[contextlib.AbstractContextManager, ...]:
    """torch checkpoint's ``context_fn``, called as each checkpointed layer runs forward: the
    forward's context (nothing) and the recomputation's (the attention of this forward)."""
    return contextlib.nullcontext(), _attention(config, config._attn_implementation)


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Checkpoint every decoder layer of ``model`` (active in training mode only).

    Raises:
        UserError: the model's class does not support transformers' gradient checkpointing.
    """
    # not a transformers model (a backend's own, e.g. Megatron's, which has its own recompute)
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserError(
            f"config trainer.gradient_checkpointing: {type(model).__name__} does not support "
            "gradient checkpointing; set trainer.gradient_checkpointing=false"
        )
    context_fn = functools.partial(_contexts, model.config)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": context_fn}
    )
