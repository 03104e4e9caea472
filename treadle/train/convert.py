"""The weight-conversion contract: every training backend exposes its weights as one stream of
``(hf_name, tensor, Layout)``, and every engine consumes Hugging Face names.

With N training backends (torch/FSDP2, DeepSpeed ZeRO, Megatron) and M engines (vLLM,
transformers, SGLang), converting each pair directly is N x M adapters. Here each trainer writes
one adapter to the stream (its parameters renamed to Hugging Face names, each tensor full or a
shard described by a :class:`Layout`), and each engine one adapter from Hugging Face names
(a full tensor, or its tensor-parallel slice from :func:`tp_layout`): N + M. Between them sits
one step, :func:`reshard`, which gathers a trainer's pieces and slices them per engine rank.

Everything here is a pure function of tensors: no torch.distributed calls. The collectives that
bring a trainer's pieces together (an all-gather of a bucket of shards) live with the trainer
(:mod:`treadle.cluster.trainer_worker`); :func:`shard` and :func:`gather` say what they must
produce. Megatron's own fused layouts (QKV, gate/up) map to Hugging Face names before they enter
the stream.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

Kind = Literal["full", "dim_shard", "flat_partition"]

VOCAB_PADDING = 64
"""vLLM pads a vocabulary-parallel embedding's rows to a multiple of this
(``vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE``) before it
splits them evenly over the tensor-parallel ranks."""


@dataclass(frozen=True)
class Layout:
    """What part of a parameter a tensor in the stream holds.

    - ``full``: the whole parameter (``rank``/``world`` are 0/1, or say which replica it is).
    - ``dim_shard``: rank ``rank``'s chunk along ``dim`` of ``world`` chunks, ``torch.chunk``
      semantics (FSDP2's ``Shard(dim)``, tensor parallelism): chunks of ``ceil(size / world)``
      rows, the last ones shorter or empty. With ``padded`` set, the dimension is first padded
      with zeros to ``padded`` rows (a multiple of ``world``) and split evenly (vLLM's vocabulary
      padding).
    - ``flat_partition``: DeepSpeed ZeRO-3: the parameter flattened, zero-padded to
      ``world * ceil(numel / world)`` elements, and rank ``rank``'s slice of
      ``ceil(numel / world)`` elements.
    """

    kind: Kind
    """``full``, ``dim_shard`` or ``flat_partition``."""
    shape: tuple[int, ...]
    """The full parameter's shape."""
    rank: int = 0
    """Which piece this is, 0 <= rank < world."""
    world: int = 1
    """How many pieces the parameter is cut into."""
    dim: int = 0
    """The dimension a ``dim_shard`` cuts (0 for the others)."""
    padded: int | None = None
    """A ``dim_shard``'s dimension size after zero padding (None: no padding)."""

    def __post_init__(self) -> None:
        if self.kind not in ("full", "dim_shard", "flat_partition"):
            raise ValueError(f"unknown layout kind {self.kind!r}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"layout rank {self.rank} is outside world {self.world}")
        if self.kind == "dim_shard" and not 0 <= self.dim < len(self.shape):
            raise ValueError(f"dim {self.dim} is outside shape {self.shape}")
        if self.padded is not None and (
            self.kind != "dim_shard"
            or self.padded < self.shape[self.dim]
            or self.padded % self.world
        ):
            raise ValueError(
                f"padded size {self.padded} must be a dim_shard's, at least the dimension "
                f"({self.shape}[{self.dim}]) and a multiple of world {self.world}"
            )

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return math.prod(self.shape)

    def span(self) -> tuple[int, int]:
        """``(start, stop)`` of this piece: rows along ``dim`` of the (padded) dimension for a
        ``dim_shard``, elements of the padded flat parameter for a ``flat_partition``,
        ``(0, numel)`` for ``full``."""
        if self.kind == "full":
            return 0, self.numel
        if self.kind == "flat_partition":
            size = -(-self.numel // self.world)
            return self.rank * size, (self.rank + 1) * size
        rows = self.shape[self.dim] if self.padded is None else self.padded
        size = -(-rows // self.world)
        return min(self.rank * size, rows), min((self.rank + 1) * size, rows)

    def piece_shape(self) -> tuple[int, ...]:
        """The shape of the tensor this layout describes."""
        start, stop = self.span()
        if self.kind == "full":
            return self.shape
        if self.kind == "flat_partition":
            return (stop - start,)
        return (*self.shape[: self.dim], stop - start, *self.shape[self.dim + 1 :])

    def region(self) -> tuple[int, int] | None:
        """``(offset, count)``: where this piece's real (unpadded) elements lie in the full
        tensor's flattened view, when they are one contiguous range there (``full``, a
        ``flat_partition``, a ``dim_shard`` along dim 0); None for a ``dim_shard`` along a
        later dimension. What lets a transport move a piece straight into the full tensor."""
        if self.kind == "full":
            return 0, self.numel
        start, stop = self.span()
        if self.kind == "flat_partition":
            return min(start, self.numel), max(0, min(stop, self.numel) - start)
        if self.dim != 0:
            return None
        rest = self.numel // self.shape[0] if self.shape[0] else 0
        rows = max(0, min(stop, self.shape[0]) - start)
        return min(start, self.shape[0]) * rest, rows * rest


def full(shape: Iterable[int]) -> Layout:
    """The layout of a whole parameter of ``shape``."""
    return Layout("full", tuple(shape))


def shard(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Rank ``layout.rank``'s piece of the full ``tensor`` (a view where it can be, a new tensor
    where zero padding is added).

    Raises:
        ValueError: ``tensor``'s shape is not ``layout.shape``.
    """
    if tuple(tensor.shape) != layout.shape:
        raise ValueError(f"tensor of shape {tuple(tensor.shape)} for a layout of {layout.shape}")
    if layout.kind == "full":
        return tensor
    start, stop = layout.span()
    if layout.kind == "flat_partition":
        flat = tensor.reshape(-1)
        piece = flat.new_zeros(stop - start)
        real = max(0, min(stop, layout.numel) - start)
        piece[:real] = flat[start : start + real]
        return piece
    size = layout.shape[layout.dim]
    real = max(0, min(stop, size) - start)
    view = tensor.narrow(layout.dim, min(start, size), real)
    if real == stop - start:
        return view
    piece = tensor.new_zeros(layout.piece_shape())
    piece.narrow(layout.dim, 0, real).copy_(view)
    return piece


def gather(
    pieces: list[tuple[torch.Tensor, Layout]], out: torch.Tensor | None = None
) -> torch.Tensor:
    """The full parameter from its pieces (any order): one copy of ``full`` (replicas are
    interchangeable), or all ``world`` pieces of a ``dim_shard`` or ``flat_partition``, padding
    dropped. Written into ``out`` (the full shape; its dtype may differ, values are cast) when
    given, else into a new tensor; a ``full`` piece is returned as is without ``out``.

    Raises:
        ValueError: no pieces, pieces of different parameters or kinds, a rank missing or
            repeated, a piece whose shape is not its layout's, or ``out`` of another shape.
    """
    if not pieces:
        raise ValueError("no pieces to gather")
    first = pieces[0][1]
    for tensor, layout in pieces:
        same = (layout.kind, layout.shape, layout.world, layout.dim, layout.padded)
        if same != (first.kind, first.shape, first.world, first.dim, first.padded):
            raise ValueError(f"pieces of different layouts: {first} and {layout}")
        if tuple(tensor.shape) != layout.piece_shape():
            raise ValueError(f"piece of shape {tuple(tensor.shape)} for {layout}")
    if out is not None and tuple(out.shape) != first.shape:
        raise ValueError(f"out of shape {tuple(out.shape)} for {first}")
    if first.kind == "full":
        return pieces[0][0] if out is None else out.copy_(pieces[0][0])
    ranks = sorted(layout.rank for _, layout in pieces)
    if ranks != list(range(first.world)):
        raise ValueError(f"need ranks 0..{first.world - 1} of {first}, got {ranks}")
    if out is None:
        out = pieces[0][0].new_empty(first.shape)
    flat = out.view(-1) if first.kind == "flat_partition" else out
    size = first.numel if first.kind == "flat_partition" else first.shape[first.dim]
    for tensor, layout in pieces:  # the padding past ``size`` is dropped
        start, stop = layout.span()
        real = max(0, min(stop, size) - start)
        if first.kind == "flat_partition":
            flat[start : start + real].copy_(tensor[:real])
        else:
            flat.narrow(first.dim, start, real).copy_(tensor.narrow(first.dim, 0, real))
    return out


# --- the engines' tensor-parallel layout (vLLM's Qwen2 / Llama) --------------------------------

_COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_REPLICATED = re.compile(r"(norm\.weight|\.(o_proj|down_proj)\.bias)$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


def tp_layout(hf_name: str, shape: Iterable[int], rank: int, world: int) -> Layout:
    """How a tensor-parallel engine rank holds Hugging Face parameter ``hf_name`` (of full
    ``shape``) of a Qwen2/Qwen3/Llama model, as vLLM slices it (Megatron-LM's scheme, Shoeybi et
    al. 2019, arXiv:1909.08053):

    - column-parallel ``q/k/v/gate/up_proj`` weights and biases: ``dim_shard`` along dim 0;
    - row-parallel ``o_proj``/``down_proj`` weights: ``dim_shard`` along dim 1, their biases
      replicated (``full``);
    - ``embed_tokens``/``lm_head``: vocabulary-parallel along dim 0, the rows padded to a
      multiple of :data:`VOCAB_PADDING` and split evenly (padding rows are zeros);
    - norms: replicated.

    k/v projections with fewer heads than ``world`` (vLLM replicates them) are not handled: the
    head count is not in the name.

    Raises:
        ValueError: a name outside these families, or a padded vocabulary not divisible by
            ``world``.
    """
    shape = tuple(shape)
    if world == 1 or _REPLICATED.search(hf_name):
        return Layout("full", shape, rank, world)
    if _COLUMN.search(hf_name):
        return Layout("dim_shard", shape, rank, world, dim=0)
    if _ROW.search(hf_name):
        return Layout("dim_shard", shape, rank, world, dim=1)
    if _VOCAB.search(hf_name):
        padded = -(-shape[0] // VOCAB_PADDING) * VOCAB_PADDING
        if padded % world:
            raise ValueError(f"{hf_name}: {padded} padded vocabulary rows over {world} ranks")
        return Layout("dim_shard", shape, rank, world, dim=0, padded=padded)
    raise ValueError(f"{hf_name}: no tensor-parallel rule for this name (Qwen2/Llama families)")


Stream = Iterable[tuple[str, torch.Tensor, Layout]]
"""What a training backend emits: ``(hf_name, tensor, layout)``, a parameter's pieces in any
order (interleaved with other parameters' is fine)."""


def reshard(
    stream: Stream, engine_rank: int, engine_world: int
) -> Iterator[tuple[str, torch.Tensor, Layout]]:
    """Convert a trainer's stream to engine rank ``engine_rank``'s of ``engine_world``: each
    parameter's pieces are gathered as soon as all of them arrived, then sliced by
    :func:`tp_layout` (at ``engine_world`` 1 the full tensor, with a ``full`` layout). Yields in
    the order parameters complete.

    Raises:
        ValueError: from :func:`gather` / :func:`tp_layout`, or when the stream ends with a
            parameter's pieces missing.
    """
    waiting: dict[str, list[tuple[torch.Tensor, Layout]]] = {}
    for name, tensor, layout in stream:
        pieces = waiting.setdefault(name, [])
        pieces.append((tensor, layout))
        if layout.kind != "full" and len(pieces) < layout.world:
            continue
        whole = gather(waiting.pop(name))
        target = tp_layout(name, whole.shape, engine_rank, engine_world)
        yield name, shard(whole, target), target
    if waiting:
        raise ValueError(f"the stream ended with pieces missing: {sorted(waiting)}")


def hf_stream(
    state: dict[str, torch.Tensor], layout_of: Callable[[str, tuple[int, ...]], list[Layout]]
) -> Iterator[tuple[str, torch.Tensor, Layout]]:
    """The stream of a Hugging Face ``state`` cut by ``layout_of(name, shape)``, which returns the
    layouts of every piece of that parameter (what a sharded trainer holds, all ranks together;
    used by tests and single-process backends)."""
    for name, tensor in state.items():
        for layout in layout_of(name, tuple(tensor.shape)):
            yield name, shard(tensor, layout), layout
