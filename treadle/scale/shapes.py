"""Model shapes: the sizes that decide parameters, FLOPs, activations and KV cache.

A shape comes from a Hugging Face ``config.json`` (Llama, Qwen2/3, Mistral, and DeepSeek-V3's
multi-head latent attention and mixture of experts) or from a name in :data:`NAMED`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from treadle.core.errors import UserError
from treadle.scale.values import number

MAX_SIZE = 2**20
"""The largest count or width a shape (or its config.json) may give (1,048,576: every
released model's sizes are below it, and the arithmetic stays in floating point's range)."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes. Counts are elements, not bytes."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    """FFN width of a dense layer (SwiGLU: three matrices of hidden x intermediate)."""
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    gated_mlp: bool = True
    """SwiGLU (three matrices); False: a GPT MLP of two matrices (Korthikanti et al.'s model)."""
    experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    experts_active: int = 0
    shared_experts: int = 0
    expert_intermediate: int = 0
    dense_layers: int = 0
    """Layers with a dense FFN in an MoE model (DeepSeek-V3: its first 3; Qwen-MoE's
    ``mlp_only_layers`` and the layers ``decoder_sparse_step`` skips)."""
    q_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V2/V3, arXiv 2405.04434): 0 for standard attention."""
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        """Raises UserError naming a size that is not a whole count in range (a shape built in
        Python; :func:`from_hf_config` names config.json's keys instead): the widths and counts
        1..:data:`MAX_SIZE`, the KV heads a divisor of the heads (unless MLA, whose KV heads
        are the heads), the active experts 1..experts, the dense layers 0..layers."""
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            number(f"{self.name}: {name}", getattr(self, name), 1, MAX_SIZE, integer=True)
        for name in ("experts", "shared_experts", "expert_intermediate", "q_lora_rank",
                     "kv_lora_rank", "rope_head_dim", "v_head_dim"):  # fmt: skip
            number(f"{self.name}: {name}", getattr(self, name), 0, MAX_SIZE, integer=True)
        if not self.mla and self.heads % self.kv_heads:
            raise UserError(f"{self.name}: kv_heads {self.kv_heads} must divide heads {self.heads}")
        if self.experts:
            number(f"{self.name}: experts_active", self.experts_active, 1, self.experts,
                   integer=True)  # fmt: skip
            number(f"{self.name}: expert_intermediate", self.expert_intermediate, 1, MAX_SIZE,
                   integer=True)  # fmt: skip
        number(f"{self.name}: dense_layers", self.dense_layers, 0, self.layers, integer=True)

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention."""
        return self.kv_lora_rank > 0

    @property
    def q_dim(self) -> int:
        """Width of the queries (heads x head_dim)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the keys, and of the values (kv_heads x head_dim)."""
        return self.kv_heads * self.head_dim

    def attention_params(self) -> int:
        """Parameters of one layer's attention, its norm included."""
        h = self.hidden
        if self.mla:
            qk = self.head_dim + self.rope_head_dim  # head_dim is the no-RoPE part
            q_out = self.heads * qk  # q_a and q_b through the latent, or one q_proj (V2-Lite)
            q = (h + q_out) * self.q_lora_rank if self.q_lora_rank else h * q_out
            kv = h * (self.kv_lora_rank + self.rope_head_dim)
            kv += self.kv_lora_rank * self.heads * (self.head_dim + self.v_head_dim)
            return q + kv + self.heads * self.v_head_dim * h + h
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + bias + h

    def ffn_params(self, width: int) -> int:
        """Parameters of one FFN of ``width`` (its norm not included)."""
        return (3 if self.gated_mlp else 2) * self.hidden * width

    @property
    def moe_layers(self) -> int:
        """Layers with a mixture-of-experts FFN."""
        return self.layers - self.dense_layers if self.experts else 0

    def params(self) -> int:
        """All parameters (embeddings and output layer included)."""
        dense = self.layers - self.moe_layers
        expert = self.ffn_params(self.expert_intermediate)
        moe = (self.experts + self.shared_experts) * expert + self.experts * self.hidden
        total = self.layers * (self.attention_params() + self.hidden)  # + the FFN norm
        total += dense * self.ffn_params(self.intermediate) + self.moe_layers * moe
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return total + embeddings + self.hidden

    def active_params(self) -> int:
        """Parameters one token passes through: the routed experts it uses, not all of them;
        the input embedding (a lookup, no FLOPs) left out. 2 x this is a token's forward FLOPs
        (Kaplan et al. 2020, arXiv 2001.08361, Eq. 2.2, without the attention term)."""
        expert = self.ffn_params(self.expert_intermediate)
        unused = self.moe_layers * (self.experts - self.experts_active) * expert
        return (
            self.params() - unused - self.vocab * self.hidden * (0 if self.tied_embeddings else 1)
        )

    def expert_parallel(self, dp: int) -> int:
        """Expert-parallel degree over ``dp`` data-parallel ranks: the most that divides both
        the ranks and the experts (Megatron requires both; each expert group then repeats over
        ``dp / ep`` ranks, its expert data parallelism); 1 for a dense model."""
        return math.gcd(dp, self.experts) if self.experts else 1

    def lora_params(self, rank: int) -> int:
        """Parameters of rank-``rank`` LoRA adapters (Hu et al. 2021, arXiv 2106.09685), ``A [r,
        in]`` and ``B [out, r]``, ``rank x (in + out)`` a linear, where PEFT puts them in
        transformers' modules for treadle's default targets (q/k/v/o, gate/up/down) or
        ``all-linear``: every attention projection (MLA's latent ones too), the dense FFNs and
        a shared expert (one linear as wide as its experts); not the routed experts, fused 3-D
        weights in transformers' MoE modules that PEFT does not adapt, nor the router or the
        output layer."""
        h = self.hidden
        if self.mla:
            q_out = self.heads * (self.head_dim + self.rope_head_dim)
            q = (h + self.q_lora_rank) + (self.q_lora_rank + q_out) if self.q_lora_rank else (
                h + q_out)  # fmt: skip
            kv = (h + self.kv_lora_rank + self.rope_head_dim) + (
                self.kv_lora_rank + self.heads * (self.head_dim + self.v_head_dim))  # fmt: skip
            attention = q + kv + (self.heads * self.v_head_dim + h)
        else:
            attention = 2 * (h + self.q_dim) + 2 * (h + self.kv_dim)  # q, o; k, v
        matrices = 3 if self.gated_mlp else 2

        def ffn(width: int) -> int:
            """An FFN's adapters per rank: gate, up and down (or up and down) of ``width``."""
            return matrices * (h + width) if width else 0

        dense = (self.layers - self.moe_layers) * ffn(self.intermediate)
        shared = self.moe_layers * ffn(self.shared_experts * self.expert_intermediate)
        return rank * (self.layers * attention + dense + shared)

    def expert_params(self) -> int:
        """Parameters of all routed experts (what expert parallelism shards)."""
        return self.moe_layers * self.experts * self.ffn_params(self.expert_intermediate)

    def kv_elements_per_token(self) -> int:
        """KV cache elements one token keeps, over all layers: 2 x kv_heads x head_dim per
        layer, or MLA's compressed latent plus its RoPE key (kv_lora_rank + rope_head_dim)."""
        per_layer = self.kv_lora_rank + self.rope_head_dim if self.mla else 2 * self.kv_dim
        return self.layers * per_layer

    def attention_flops_per_token(self, context: float) -> float:
        """Forward FLOPs of the attention scores and their weighted sum for one token that
        attends to ``context`` tokens: 2 matmuls x 2 FLOPs x q_dim x context, per layer."""
        width = self.heads * (self.head_dim + self.rope_head_dim) if self.mla else self.q_dim
        return 4.0 * self.layers * width * context


NAMED: dict[str, ModelShape] = {
    s.name: s
    for s in (
        # ZeRO (arXiv 1910.02054) Fig. 1's 7.5B model: Megatron GPT, 4h MLP
        ModelShape("gpt-7.5b", 72, 2912, 32, 32, 91, 4 * 2912, 50257, True, False, False),
        ModelShape("llama3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelShape("qwen2.5-0.5b", 24, 896, 14, 2, 64, 4864, 151936, True, True),
        ModelShape("qwen2.5-1.5b", 28, 1536, 12, 2, 128, 8960, 151936, True, True),
        ModelShape("r1-distill-qwen-1.5b", 28, 1536, 12, 2, 128, 8960, 151936, False, True),
        ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, False, True),
        ModelShape("qwen2.5-math-7b", 28, 3584, 28, 4, 128, 18944, 152064, False, True),
        ModelShape("qwen2.5-32b", 64, 5120, 40, 8, 128, 27648, 152064, False, True),
        ModelShape("llama3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256),
        ModelShape("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 6144, 151936,
                   experts=128, experts_active=8, expert_intermediate=768),
        ModelShape(
            "deepseek-v3", 61, 7168, 128, 128, 128, 18432, 129280,
            experts=256, experts_active=8, shared_experts=1, expert_intermediate=2048,
            dense_layers=3, q_lora_rank=1536, kv_lora_rank=512, rope_head_dim=64, v_head_dim=128,
        ),
    )
}  # fmt: skip
"""Named shapes, from each model's published ``config.json``."""


POSITIVE = ("num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size",
            "vocab_size")  # fmt: skip
"""The config.json keys every shape needs, each a positive integer."""


def _positive(name: str, key: str, value: object) -> int:
    """``value`` of config.json's ``key``, a positive integer of at most :data:`MAX_SIZE`,
    else UserError naming both."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
        raise UserError(f"{name}: config.json's {key} is {_short(value)}; a positive integer "
                        f"up to {MAX_SIZE:,}")  # fmt: skip
    return value


def _count(name: str, config: dict, key: str) -> int:
    """config.json's optional ``key``: 0 where absent or null, else an integer of 0 to
    :data:`MAX_SIZE` (UserError naming the key otherwise)."""
    value = config.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SIZE:
        raise UserError(f"{name}: config.json's {key} is {_short(value)}; an integer of 0 or "
                        f"more, up to {MAX_SIZE:,}")  # fmt: skip
    return value


def _flag(name: str, config: dict, key: str, default: bool) -> bool:
    """config.json's optional true/false ``key`` (``default`` where absent or null)."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UserError(f"{name}: config.json's {key} is {_short(value)}; true or false")
    return value


def _short(value: object) -> str:
    """``repr(value)``, cut to 40 characters (a huge number or string stays one short line);
    JSON's null, true and false as config.json writes them."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge number"
    return text if len(text) <= 40 else text[:37] + "..."


def from_hf_config(config: dict, name: str) -> ModelShape:
    """The shape of a Hugging Face ``config.json`` (already parsed): dense Llama/Qwen/Mistral
    layouts, mixtures of experts (:func:`_with_experts`) and multi-head latent attention.

    Raises:
        UserError: not a JSON object, a key the shape needs missing or not a positive integer,
            KV heads that do not divide the heads, or experts without their sizes (names the
            key and the file).
    """
    if not isinstance(config, dict):
        raise UserError(f"{name}: config.json holds a {type(config).__name__}, not an object")
    for key in POSITIVE:
        if key not in config:
            raise UserError(f"{name}: config.json has no {key!r}; pass a named shape")
        _positive(name, key, config[key])
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    given = config.get("num_key_value_heads")
    kv_heads = heads if given is None else _positive(name, "num_key_value_heads", given)
    if heads % kv_heads:
        raise UserError(
            f"{name}: config.json's num_key_value_heads {kv_heads} does not divide "
            f"num_attention_heads {heads}"
        )
    # the first given of MLA's no-RoPE query width and head_dim, else hidden / heads
    key = next((k for k in ("qk_nope_head_dim", "head_dim") if config.get(k) is not None), None)
    head_dim = config[key] if key else hidden // heads
    if not key and head_dim < 1:
        raise UserError(f"{name}: config.json's hidden_size {hidden} / num_attention_heads {heads} "
                        "gives a head_dim of 0; give head_dim")  # fmt: skip
    shape = ModelShape(
        name=name,
        layers=config["num_hidden_layers"],
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=_positive(name, key or "head_dim", head_dim),
        intermediate=config["intermediate_size"],
        vocab=config["vocab_size"],
        tied_embeddings=_flag(name, config, "tie_word_embeddings", False),
        qkv_bias=_flag(name, config, "attention_bias", config.get("model_type") == "qwen2"),
    )
    shape = _with_experts(config, shape)
    if _count(name, config, "kv_lora_rank"):
        shape = replace(
            shape,
            q_lora_rank=_count(name, config, "q_lora_rank"),
            kv_lora_rank=config["kv_lora_rank"],
            rope_head_dim=_count(name, config, "qk_rope_head_dim"),
            v_head_dim=_count(name, config, "v_head_dim") or shape.head_dim,
        )
    return shape


def _with_experts(config: dict, shape: ModelShape) -> ModelShape:
    """``shape`` with the mixture of experts of ``config``, if any: DeepSeek's
    ``n_routed_experts``, Qwen's ``num_experts`` (its one wide shared expert counted as
    ``shared_expert_intermediate_size / moe_intermediate_size`` experts), Mixtral's
    ``num_local_experts`` (experts ``intermediate_size`` wide); the layers with a dense FFN
    from :func:`_dense_layers`."""
    name = shape.name
    key = next((k for k in ("n_routed_experts", "num_experts", "num_local_experts")
                if config.get(k) is not None and config.get(k) != 0), None)  # fmt: skip
    if key is None:
        return shape
    routed = _positive(name, key, config[key])
    width = config.get("moe_intermediate_size") or (
        config["intermediate_size"] if config.get("num_local_experts") else None
    )
    for key, value in (("num_experts_per_tok", config.get("num_experts_per_tok")),
                       ("moe_intermediate_size", width)):  # fmt: skip
        if value is None:
            raise UserError(f"{name}: config.json has {routed} experts but no {key!r}")
        _positive(name, key, value)
    if config["num_experts_per_tok"] > routed:
        raise UserError(f"{name}: config.json's num_experts_per_tok {config['num_experts_per_tok']}"
                        f" is more than its {routed} experts")  # fmt: skip
    shared = _count(name, config, "n_shared_experts")
    if _count(name, config, "shared_expert_intermediate_size"):
        shared = max(1, round(config["shared_expert_intermediate_size"] / width))
    return replace(
        shape,
        experts=routed,
        experts_active=config["num_experts_per_tok"],
        shared_experts=shared,
        expert_intermediate=width,
        dense_layers=_dense_layers(config, shape),
    )


def _dense_layers(config: dict, shape: ModelShape) -> int:
    """How many of ``shape``'s layers keep a dense FFN: layer i has experts where i >=
    ``first_k_dense_replace`` (absent: transformers' default, 3 for ``deepseek_v3``, else 0)
    and i % ``moe_layer_freq`` == 0 (DeepSeek-V2/V3's own modeling code; transformers' ignores
    it, and the released configs give 1), and where (i + 1) % ``decoder_sparse_step`` == 0 and
    i is not in ``mlp_only_layers`` (transformers' Qwen2/3-MoE). Raises UserError for a value
    of those keys that is not an integer of the range its meaning allows, naming it (a
    ``first_k_dense_replace`` past the last layer leaves every layer dense, as transformers'
    code builds it)."""
    layers = shape.layers
    first = config.get("first_k_dense_replace")
    if first is None:
        first = 3 if config.get("model_type") == "deepseek_v3" else 0
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:  # past the last: dense
        raise UserError(f"{shape.name}: config.json's first_k_dense_replace is {_short(first)}; "
                        "an integer of 0 or more")  # fmt: skip
    every = {k: _positive(shape.name, k, 1 if config.get(k) is None else config[k])
             for k in ("moe_layer_freq", "decoder_sparse_step")}  # fmt: skip
    only = [] if config.get("mlp_only_layers") is None else config["mlp_only_layers"]
    if not isinstance(only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in only
    ):
        raise UserError(f"{shape.name}: config.json's mlp_only_layers is {_short(only)}; a list of "
                        f"layer indices 0..{layers - 1}")  # fmt: skip
    excluded = set(only)  # a set: a list of thousands of layers makes this quadratic
    sparse = [i for i in range(first, layers) if i % every["moe_layer_freq"] == 0
              and (i + 1) % every["decoder_sparse_step"] == 0 and i not in excluded]  # fmt: skip
    return layers - len(sparse)


def resolve(model: str) -> ModelShape:
    """The shape of a model folder (or its ``config.json``), or a named shape: a folder holding
    a ``config.json`` comes first, as in transformers' ``from_pretrained``, so a folder named
    like a shape (``./qwen2.5-7b``) is read, not shadowed.

    Raises:
        UserError: neither a name in :data:`NAMED` nor a readable ``config.json``.
    """
    path = Path(model)
    try:  # a name the file system refuses (over 255 bytes: ENAMETOOLONG) is bad input
        local = (path / "config.json").is_file()
        path = path / "config.json" if path.is_dir() else path
    except OSError as e:
        raise UserError(f"model {model[:80]!r}...: {e.strerror or e}") from None
    if model in NAMED and not local:
        return NAMED[model]
    if path.is_dir():
        raise UserError(f"model {model!r}: {path} is a folder, not a config.json file")
    if not path.is_file():
        names = ", ".join(NAMED)
        raise UserError(f"model {model!r}: not a named shape ({names}) nor a config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise UserError(f"model {path}: cannot read it as JSON ({e})") from None
    return from_hf_config(config, path.parent.name or str(path))
