"""Hugging Face <-> megatron-core GPTModel weights for the Qwen2 and Llama families (pure
functions of state dicts; no process group, no Megatron import).

Megatron's names are those of a GPTModel built with the local layer spec
(``get_gpt_layer_local_spec(normalization="RMSNorm")``). Its layouts differ from HF's in two
fused matrices, both column-parallel (rows split across tensor-parallel ranks):

- ``self_attention.linear_qkv`` ``[G * (r + 2) * d, H]`` (G KV heads, r = heads / G queries per
  KV head, head dim d): per query group g, the rows of its r query heads, then k_g, then v_g.
  Rank t of a TP group of size P holds groups ``t * G/P .. (t+1) * G/P - 1``: a contiguous
  chunk of the fused matrix (so G must divide by P). The q/k/v biases (Qwen2) likewise.
- ``mlp.linear_fc1`` ``[2 * I, H]``: on each rank ``[gate_t; up_t]``, the rank's row chunk of
  ``gate_proj`` then that of ``up_proj`` (SwiGLU splits its input in halves per rank).

Row-parallel ``linear_proj`` and ``linear_fc2`` split their columns; the vocab-parallel
embedding and output layer split the vocabulary's rows; norms are replicated.

A vocabulary the TP size does not divide is padded with zero rows up to the next multiple (as
Megatron-LM's ``make_vocab_size_divisible_by``); the backend keeps the padded logits out of the
softmax, so their rows get no gradient, and :func:`to_hf` drops them again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Split = Literal["rows", "columns", "replicated"]
"""How a Megatron parameter is divided over the tensor-parallel ranks: along dim 0 (column-
parallel linears, vocab-parallel embedding/output), along dim 1 (row-parallel linears) or not
at all (norms)."""


@dataclass(frozen=True)
class MegatronShape:
    """The dimensions of a Qwen2/Llama decoder that the conversion needs."""

    layers: int
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (query groups, G)."""
    head_dim: int
    """d."""
    qkv_bias: bool
    """Whether q/k/v projections carry biases (Qwen2: yes; Llama: ``attention_bias``)."""
    tied: bool
    """Whether the output layer is the input embedding (``tie_word_embeddings``)."""
    vocab: int | None = None
    """The HF embedding's rows (:func:`to_hf` keeps these many; None: all it is given)."""

    @classmethod
    def from_hf_config(cls, config) -> MegatronShape:
        """The shape of a transformers ``Qwen2Config`` or ``LlamaConfig``."""
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        qwen2 = config.model_type == "qwen2"
        return cls(
            layers=config.num_hidden_layers,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            qkv_bias=qwen2 or bool(getattr(config, "attention_bias", False)),
            tied=bool(config.tie_word_embeddings),
            vocab=config.vocab_size,
        )


def padded_vocab(vocab: int, tp: int) -> int:
    """The embedding rows Megatron holds: ``vocab`` rounded up to a multiple of ``tp``."""
    return -(-vocab // tp) * tp


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows``."""
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def split_of(name: str) -> Split:
    """How the Megatron parameter ``name`` is divided over tensor-parallel ranks."""
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "columns"
    if "layernorm" in name:
        return "replicated"
    return "rows"


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: MegatronShape) -> torch.Tensor:
    """Megatron's fused ``[G * (r + 2) * d, ...]`` from HF's ``q [heads * d, ...]``,
    ``k, v [G * d, ...]`` (weights or biases): per group, its r query heads, then k, then v."""
    g, d = s.kv_heads, s.head_dim
    rest = q.shape[1:]
    qg = q.reshape(g, (s.heads // g) * d, *rest)
    return torch.cat([qg, k.reshape(g, d, *rest), v.reshape(g, d, *rest)], 1).reshape(-1, *rest)


def unfuse_qkv(
    fused: torch.Tensor, s: MegatronShape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`fuse_qkv`: HF's ``(q, k, v)``."""
    g, d = s.kv_heads, s.head_dim
    rest = fused.shape[1:]
    r = s.heads // g
    q, k, v = fused.reshape(g, (r + 2) * d, *rest).split([r * d, d, d], 1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _chunks(t: torch.Tensor, split: Split, tp: int) -> list[torch.Tensor]:
    """``t``'s ``tp`` shards along ``split`` (copies, so shards own their memory)."""
    if split == "replicated":
        return [t.clone() for _ in range(tp)]
    return [c.clone() for c in t.chunk(tp, 0 if split == "rows" else 1)]


def _layer_to_megatron(hf: Mapping[str, torch.Tensor], i: int, s: MegatronShape, tp: int):
    """Layer ``i``'s Megatron parameters, each as its ``tp`` shards."""
    a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    out = f"decoder.layers.{i}."
    shards = {
        out + "input_layernorm.weight": _chunks(
            hf[f"model.layers.{i}.input_layernorm.weight"], "replicated", tp
        ),
        out + "pre_mlp_layernorm.weight": _chunks(
            hf[f"model.layers.{i}.post_attention_layernorm.weight"], "replicated", tp
        ),
        out + "self_attention.linear_proj.weight": _chunks(hf[a + "o_proj.weight"], "columns", tp),
        out + "mlp.linear_fc2.weight": _chunks(hf[m + "down_proj.weight"], "columns", tp),
    }
    for kind in ("weight", "bias") if s.qkv_bias else ("weight",):
        qkv = fuse_qkv(*(hf[a + f"{p}_proj.{kind}"] for p in "qkv"), s)
        shards[out + f"self_attention.linear_qkv.{kind}"] = _chunks(qkv, "rows", tp)
    gate, up = hf[m + "gate_proj.weight"].chunk(tp, 0), hf[m + "up_proj.weight"].chunk(tp, 0)
    shards[out + "mlp.linear_fc1.weight"] = [torch.cat(gu) for gu in zip(gate, up, strict=True)]
    return shards


def to_megatron(
    hf: Mapping[str, torch.Tensor], s: MegatronShape, tp: int = 1
) -> list[dict[str, torch.Tensor]]:
    """Megatron GPTModel state dicts, one per tensor-parallel rank (``tp`` of them), from an HF
    Qwen2/Llama ``*ForCausalLM`` state dict (``lm_head.weight`` may be absent when tied); the
    vocabulary's rows are padded to :func:`padded_vocab`.

    Raises:
        ValueError: ``tp`` does not divide the KV heads or the intermediate size.
    """
    rows = padded_vocab(hf["model.embed_tokens.weight"].shape[0], tp)
    inter = hf["model.layers.0.mlp.up_proj.weight"].shape[0]
    for what, n in (("KV heads", s.kv_heads), ("intermediate size", inter)):
        if n % tp:
            raise ValueError(f"tensor parallel {tp} does not divide the {what} ({n})")
    embedding = _pad_rows(hf["model.embed_tokens.weight"], rows)
    shards = {
        "embedding.word_embeddings.weight": _chunks(embedding, "rows", tp),
        "decoder.final_layernorm.weight": _chunks(hf["model.norm.weight"], "replicated", tp),
    }
    if not s.tied:
        shards["output_layer.weight"] = _chunks(_pad_rows(hf["lm_head.weight"], rows), "rows", tp)
    for i in range(s.layers):
        shards |= _layer_to_megatron(hf, i, s, tp)
    return [{name: parts[t] for name, parts in shards.items()} for t in range(tp)]


def gather(name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full Megatron parameter ``name`` from its per-rank shards ``parts`` (in rank order;
    the fused fc1 stays in its per-rank ``[gate_t; up_t]`` order)."""
    split = split_of(name)
    if split == "replicated":
        return parts[0]
    return torch.cat(list(parts), 0 if split == "rows" else 1)


def to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]], s: MegatronShape
) -> dict[str, torch.Tensor]:
    """The HF Qwen2/Llama ``*ForCausalLM`` state dict of Megatron state dicts, one per TP rank
    in rank order (the inverse of :func:`to_megatron`; ``lm_head.weight`` is the embedding
    when tied, as transformers' own state dict has it; the vocabulary's padding rows dropped,
    ``s.vocab`` kept). Megatron's ``_extra_state`` entries are ignored.

    Raises:
        KeyError: a parameter of the shape is missing.
    """

    def full(name: str) -> torch.Tensor:
        return gather(name, [shard[name] for shard in shards])

    tp = len(shards)
    hf = {
        "model.embed_tokens.weight": full("embedding.word_embeddings.weight")[: s.vocab],
        "model.norm.weight": full("decoder.final_layernorm.weight"),
    }
    hf["lm_head.weight"] = (
        hf["model.embed_tokens.weight"] if s.tied else full("output_layer.weight")[: s.vocab]
    )
    for i in range(s.layers):
        a, m, src = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"decoder.layers.{i}."
        hf[f"model.layers.{i}.input_layernorm.weight"] = full(src + "input_layernorm.weight")
        hf[f"model.layers.{i}.post_attention_layernorm.weight"] = full(
            src + "pre_mlp_layernorm.weight"
        )
        hf[a + "o_proj.weight"] = full(src + "self_attention.linear_proj.weight")
        hf[m + "down_proj.weight"] = full(src + "mlp.linear_fc2.weight")
        for kind in ("weight", "bias") if s.qkv_bias else ("weight",):
            q, k, v = unfuse_qkv(full(src + f"self_attention.linear_qkv.{kind}"), s)
            hf[a + f"q_proj.{kind}"], hf[a + f"k_proj.{kind}"], hf[a + f"v_proj.{kind}"] = q, k, v
        halves = [shard[src + "mlp.linear_fc1.weight"].chunk(2, 0) for shard in shards]
        hf[m + "gate_proj.weight"] = torch.cat([h[0] for h in halves[:tp]])
        hf[m + "up_proj.weight"] = torch.cat([h[1] for h in halves[:tp]])
    return hf
