"""The megatron-core backend (``trainer.backend: megatron``): a Hugging Face Qwen2/Llama policy
trained as a megatron-core ``GPTModel`` split over ``trainer.megatron.tensor_parallel`` ranks.

The same objectives, micro-batch planning and metrics as :class:`TorchBackend`; what differs:

- the model: a GPTModel (local layer spec: torch RMSNorm, SwiGLU, GQA, RoPE) whose weights are
  the HF model's, converted by :mod:`treadle.train.megatron_convert`;
- packing: several samples per micro-batch under a block-diagonal causal mask (a token attends
  only to earlier tokens of its own sample), RoPE at each token's ``position_ids``; exact, as
  each sample alone (no shared-prefix packing: that needs the HF attention hook);
- the head: logprobs and entropy from a vocab-parallel log-softmax (the max and the sum of
  exponentials all-reduced over the TP group), never gathering the ``[K, V]`` logits;
- the gradient norm counts each tensor-parallel shard once and each replicated norm weight
  once; AdamW (elementwise) runs on each rank's shards;
- :meth:`named_weights` and :meth:`save_pretrained` give HF names and full tensors, gathered
  over the TP group (collectives: every TP rank calls them).

On a CPU, megatron-core's CUDA-only spots are redirected first (:mod:`treadle.train.megatron_cpu`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import PreTrainedModel

from treadle.config import TrainerConfig
from treadle.core.batch import MicroBatch, TokenOutputs
from treadle.core.errors import UserError
from treadle.core.protocols import OptimizerState
from treadle.train import megatron_cpu
from treadle.train.megatron_convert import (
    MegatronShape,
    padded_vocab,
    split_of,
    to_hf,
    to_megatron,
)
from treadle.train.packing import Packing
from treadle.train.torch_backend import TorchBackend


def init_model_parallel(tp: int, pp: int) -> None:
    """Megatron's model-parallel groups over the default process group (a world-1 gloo group
    of this process when there is none); once per process, later calls must ask the same.

    Raises:
        UserError: pipeline parallelism, a TP size the world cannot hold, or one that differs
            from the groups already made.
    """
    if pp != 1:
        raise UserError(
            f"config trainer.megatron.pipeline_parallel={pp}: pipeline parallelism is not "
            "implemented; use trainer.megatron.pipeline_parallel=1"
        )
    megatron_cpu.install()
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if parallel_state.model_parallel_is_initialized():
        have = parallel_state.get_tensor_model_parallel_world_size()
        if have != tp:
            raise UserError(
                f"config trainer.megatron.tensor_parallel={tp}: this process already trains "
                f"with tensor parallel {have}; use trainer.megatron.tensor_parallel={have}"
            )
        return
    if world % tp:
        raise UserError(
            f"config trainer.megatron.tensor_parallel={tp}: {world} trainer process(es) cannot "
            f"hold it; use a divisor of {world} (1 in one process; in a Ray run "
            "placement.trainers)"
        )
    parallel_state.initialize_model_parallel(tp, pp)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    else:
        megatron_cpu.model_parallel_cpu_manual_seed(0)


def check_supported(config, cfg: TrainerConfig) -> None:
    """Refuse what the conversion or this machine cannot run, from the HF model ``config`` and
    the trainer config alone (before any work: :func:`treadle.train.backends.preflight`).

    Raises:
        UserError: not a Qwen2/Llama model, RoPE scaling, Llama's o_proj/MLP biases, a tensor
            parallel size that does not divide the KV heads or the MLP, or bf16 without CUDA.
    """
    if cfg.bf16_autocast and not torch.cuda.is_available():
        raise UserError(
            "config trainer.bf16_autocast=true with trainer.backend=megatron: megatron-core's "
            "linear layers autocast for CUDA only (on a CPU their backward mixes bf16 and "
            "fp32); set trainer.bf16_autocast=false"
        )
    tp = cfg.megatron.tensor_parallel
    for what, n in (("KV heads", config.num_key_value_heads), ("MLP", config.intermediate_size)):
        if n % tp:
            raise UserError(
                f"config trainer.megatron.tensor_parallel={tp}: it does not divide the model's "
                f"{what} ({n}); use a tensor parallel size that divides it (in a Ray run with "
                "placement.trainers equal to it)"
            )
    fix = "use trainer.backend=torch"
    if config.model_type not in ("qwen2", "llama"):
        raise UserError(
            f"config trainer.backend=megatron: model type {config.model_type!r} is not "
            f"converted (Qwen2 and Llama are); {fix}"
        )
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise UserError(
            f"config trainer.backend=megatron: RoPE scaling {rope.get('rope_type')!r} is not "
            f"converted; {fix}"
        )
    if config.model_type == "llama" and (config.attention_bias or config.mlp_bias):
        raise UserError(
            "config trainer.backend=megatron: Llama with attention/MLP biases is not "
            f"converted; {fix}"
        )


def build_gpt(config, vocab: int, dtype: torch.dtype) -> torch.nn.Module:
    """An (uninitialised) megatron-core GPTModel of an HF Qwen2/Llama ``config`` with ``vocab``
    embedding rows, split over the current TP group; call :func:`init_model_parallel` first."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    shape = MegatronShape.from_hf_config(config)
    tc = TransformerConfig(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,  # SwiGLU: silu(gate) * up
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=False,  # the HF weights are loaded over it
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    return GPTModel(
        tc,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vocab,
        max_sequence_length=config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=config.rope_parameters["rope_theta"],
        share_embeddings_and_output_weights=shape.tied,
        parallel_output=True,  # logits stay split over the vocabulary
    )


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """Megatron's attention mask ``[1, 1, N, N]`` (True: masked) of packed samples: token i
    attends to token j iff j <= i and both belong to the same sample (``segments [N]``)."""
    n = segments.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=segments.device).tril()
    return ~(causal & (segments[:, None] == segments[None, :]))[None, None]


def _fill(t: torch.Tensor, pad: torch.Tensor | None, value: float) -> torch.Tensor:
    """``t`` with the ``pad`` columns set to ``value`` (``t`` itself without padding)."""
    return t if pad is None else t.masked_fill(pad, value)


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, entropy_grad: bool, vocab: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target and the entropy, ``[K]`` each (nats), from this TP
    rank's vocabulary slice of the logits ``[K, V/P]`` (fp32, temperature applied); columns at
    or beyond ``vocab`` (TP padding of the vocabulary) are left out, as if absent.

    With ``z = logits - m`` (m the row max over all ranks, all-reduced, no gradient),
    ``S = sum_v exp(z_v)`` and ``A = sum_v exp(z_v) z_v`` over the whole vocabulary:
    ``log p(y) = z_y - log S`` (z_y from the rank holding y) and ``H = -sum_v p_v log p_v =
    log S - A / S``. Each rank sums its own slice and the sums are all-reduced with Megatron's
    ``reduce_from_tensor_model_parallel_region`` (identity backward) before they are combined,
    so every rank's gradient reaches exactly its own logits (as in Megatron's
    ``vocab_parallel_cross_entropy``; a reduced value must not re-enter a per-rank sum, whose
    backward would then miss the other ranks' terms).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    group = parallel_state.get_tensor_model_parallel_group()
    width = logits.shape[1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    pad = None  # [V/P] True on padding columns; None where this rank's slice has none
    if vocab is not None and start + width > vocab:
        pad = torch.arange(start, start + width, device=logits.device) >= vocab
    m = _fill(logits.detach(), pad, float("-inf")).max(-1).values
    if group.size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z = _fill(logits - m[:, None], pad, 0.0)  # [K, V/P]; padding: no gradient
    e = _fill(z.exp(), pad, 0.0)
    s = reduce_from_tensor_model_parallel_region(e.sum(-1))  # [K]
    mine = (targets >= start) & (targets < start + width)
    local = (targets - start).clamp(0, width - 1)
    z_y = reduce_from_tensor_model_parallel_region(z.gather(1, local[:, None])[:, 0] * mine)
    log_s = s.log()
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        a = reduce_from_tensor_model_parallel_region((e * z).sum(-1))
        entropy = log_s - a / s
    return z_y - log_s, entropy


class MegatronBackend(TorchBackend):
    """Trains an HF Qwen2/Llama causal LM as a megatron-core GPTModel (``head="lm"`` only),
    this process being one rank of a ``cfg.megatron.tensor_parallel`` group (arguments as
    :class:`TorchBackend`'s). Every rank of the TP group must make the same calls with the
    same samples.

    Raises:
        UserError: a critic (``head="value"``), an unconverted model, bf16 autocast on a CPU,
            or a parallel layout the process group cannot hold (:func:`init_model_parallel`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        cfg: TrainerConfig,
        total_steps: int,
        temperature: float = 1.0,
        trainable: bool = True,
        head: Literal["lm", "value"] = "lm",
    ):
        if head != "lm":
            raise UserError(
                "config trainer.backend=megatron: a critic (value head) is not implemented; "
                "use trainer.backend=torch"
            )
        check_supported(model.config, cfg)
        init_model_parallel(cfg.megatron.tensor_parallel, cfg.megatron.pipeline_parallel)
        from megatron.core import parallel_state

        hf = model.state_dict()
        self.vocab = hf["model.embed_tokens.weight"].shape[0]
        """The real vocabulary (the embedding's rows beyond it are TP padding)."""
        self.shape = replace(MegatronShape.from_hf_config(model.config), vocab=self.vocab)
        self.hf_model = model  # its config, parameter names and save_pretrained
        self.padding_idx: int | None = model.get_input_embeddings().padding_idx
        """The HF embedding's ``padding_idx`` (Megatron's embedding has none: see _hidden)."""
        tp = cfg.megatron.tensor_parallel
        shards = to_megatron(hf, self.shape, tp)  # its sizes were checked: check_supported
        dtype = hf["model.embed_tokens.weight"].dtype
        gpt = build_gpt(model.config, padded_vocab(self.vocab, tp), dtype)
        rank = parallel_state.get_tensor_model_parallel_rank()
        result = gpt.load_state_dict(shards[rank], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)
        gpt.to(next(model.parameters()).device)
        model.to("cpu")  # kept for its config and save_pretrained only: off the accelerator
        super().__init__(gpt, cfg, total_steps, temperature, trainable, head)

    def _probe_packing(self) -> Packing:
        """``plain``: samples packed under :func:`block_causal_mask` (exact by construction;
        the contract test checks packed logprobs against each sample's alone)."""
        return "plain"

    def _hidden(self, mb: MicroBatch) -> torch.Tensor:
        """The final-norm hidden states ``[N, 1, H]`` of a packed micro-batch."""
        m = self.model
        pos = mb.position_ids[0]
        h = m.embedding(input_ids=mb.input_ids, position_ids=mb.position_ids)  # [N, 1, H]
        if self.padding_idx is not None:  # HF's nn.Embedding(padding_idx): that row learns
            pad = (mb.input_ids[0] == self.padding_idx)[:, None, None]  # nothing as an input
            h = torch.where(pad, h.detach(), h)
        rope = m.rotary_pos_emb(int(pos.max()) + 1)[pos]  # [N, 1, 1, d]: each token's position
        return m.decoder(
            hidden_states=h, attention_mask=block_causal_mask(mb.segments), rotary_pos_emb=rope
        )

    def forward(
        self, mb: MicroBatch, entropy_grad: bool = False, loss_tokens_only: bool = False
    ) -> TokenOutputs:
        """Per-token logprobs and entropy ``[N]`` (nats) as :meth:`TorchBackend.forward`'s, the
        output layer run only on the scored positions and its vocabulary kept split."""
        ids = mb.input_ids[0]
        scored = mb.prev >= 0
        if loss_tokens_only:
            scored = scored & mb.loss_mask
        targets = torch.nonzero(scored).squeeze(1)  # [K] tokens to score
        sources = mb.prev[targets]  # [K] the position whose output predicts each of them
        m = self.model
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16_autocast):
            # index_select, not [sources]: a shared prompt's last position repeats in sources,
            # and indexing's backward sums repeats by atomic adds in the threads' order
            # (TorchBackend.forward)
            h = self._hidden(mb).index_select(0, sources)  # [K, 1, H]
            weight = m.shared_embedding_or_output_weight() if self.shape.tied else None
            logits = m.output_layer(h, weight=weight)[0][:, 0]  # [K, V/P]
        logits = logits.float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        lp, entropy = vocab_parallel_logprobs(logits, ids[targets], entropy_grad, self.vocab)
        zeros = torch.zeros(ids.shape[0], device=logits.device)
        return TokenOutputs(
            zeros.index_put((targets,), lp), zeros.index_put((targets,), entropy), None
        )

    def apply_gradients(self) -> tuple[float, float]:
        """Clip to ``cfg.grad_clip`` by the global norm (each shard and each replicated weight
        counted once over the TP group, as torch's ``clip_grad_norm_`` would over the whole
        model), one AdamW and LR-schedule step; returns the pre-clip norm and the LR applied."""
        from megatron.core import parallel_state

        # Which parameters are split is read from their names: megatron-core marks its weights
        # (``tensor_model_parallel``) only when it initialises them, and here it does not.
        rank = parallel_state.get_tensor_model_parallel_rank()
        named = [(n, p) for n, p in self.model.named_parameters() if p.grad is not None]
        grads = [p.grad for _, p in named]
        counted = [p.grad for n, p in named if rank == 0 or split_of(n) != "replicated"]
        sq = torch.stack([g.detach().float().pow(2).sum() for g in counted]).sum()
        group = parallel_state.get_tensor_model_parallel_group()
        if group.size() > 1:
            dist.all_reduce(sq, group=group)
        norm = sq.sqrt()
        if self.cfg.grad_clip > 0:  # torch's rule: scale by min(1, max / (norm + 1e-6))
            coef = torch.clamp(self.cfg.grad_clip / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        return float(norm), lr

    def hf_layout(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names and full tensors of this rank's Megatron-named shards ``local`` (its
        weights, or e.g. their gradients), gathered over the TP group: a collective."""
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        if group.size() == 1:
            return to_hf([local], self.shape)
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(group.size())]
        for name, t in local.items():
            parts = [torch.empty_like(t) for _ in shards]
            dist.all_gather(parts, t.contiguous(), group=group)
            for shard, part in zip(shards, parts, strict=True):
                shard[name] = part
        return to_hf(shards, self.shape)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights in HF layout and names (a TP collective)."""
        state = self.model.state_dict()
        return self.hf_layout(
            {k: v.detach() for k, v in state.items() if not k.endswith("_extra_state")}
        )

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and full tensors (a tied embedding under both of its names), as
        :meth:`TorchBackend.named_weights` of the HF model would give; a TP collective."""
        yield from self.hf_state_dict().items()

    def optimizer_state(self) -> OptimizerState:
        """The AdamW state of the whole model in HF names and layout (each moment gathered
        over the TP group and converted as the weights are: AdamW is elementwise, so a moment
        is laid out as its weight), and the LR schedule's; a TP collective, every rank gets
        the whole of it. It loads at any tensor-parallel size.

        Raises:
            RuntimeError: a frozen backend has no optimizer.
        """
        torch_state = super().optimizer_state()
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        hf_names = [n for n, _ in self.hf_model.named_parameters()]  # a tied lm_head: none
        per = torch_state.optimizer["state"]  # by parameter index
        state: dict[str, dict[str, torch.Tensor]] = {}
        if per:  # before the first step the state is empty, as torch's
            step = per[0]["step"]
            moments = {  # on the CPU: a checkpoint's, and what a Ray rank returns to the driver
                key: {
                    n: t.cpu()
                    for n, t in self.hf_layout({names[i]: s[key] for i, s in per.items()}).items()
                }
                for key in ("exp_avg", "exp_avg_sq")
            }
            state = {
                n: {"step": step.clone()} | {key: moments[key][n] for key in moments}
                for n in hf_names
            }
        (group,) = torch_state.optimizer["param_groups"]
        groups = [{**group, "params": hf_names}]
        return OptimizerState({"state": state, "param_groups": groups}, torch_state.scheduler)

    def load_optimizer_state(self, state: OptimizerState) -> None:
        """Restore :meth:`optimizer_state`'s result (saved at any tensor-parallel size): this
        rank takes its shards of each moment.

        Raises:
            KeyError, ValueError: the state is of another model or optimizer, or was saved
                without a schedule.
            RuntimeError: a frozen backend.
        """
        from megatron.core import parallel_state

        saved = state.optimizer
        (group,) = saved["param_groups"]
        if group["params"] and isinstance(group["params"][0], int):  # a TP-1 state of old
            if parallel_state.get_tensor_model_parallel_world_size() != 1:
                raise ValueError(
                    "the optimizer state is keyed by parameter index (saved by tensor parallel 1 "
                    "before HF-layout states): it loads at tensor parallel 1 only"
                )
            super().load_optimizer_state(state)
            return
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        per: dict[int, dict[str, torch.Tensor]] = {}
        if saved["state"]:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            rank = parallel_state.get_tensor_model_parallel_rank()
            moments = {
                key: to_megatron({n: s[key] for n, s in saved["state"].items()}, self.shape, tp)[
                    rank
                ]
                for key in ("exp_avg", "exp_avg_sq")
            }
            step = next(iter(saved["state"].values()))["step"]
            per = {
                i: {"step": step.clone()} | {k: moments[k][n].clone() for k in moments}
                for i, n in enumerate(names)
            }
        groups = [{**group, "params": list(range(len(names)))}]
        super().load_optimizer_state(
            OptimizerState({"state": per, "param_groups": groups}, state.scheduler)
        )

    def save_pretrained(self, folder: Path) -> None:
        """The model in HF format (safetensors and config), loadable by transformers and vLLM;
        a TP collective, TP rank 0 writes."""
        from megatron.core import parallel_state

        weights = self.hf_state_dict()
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            self.hf_model.load_state_dict(weights)
            self.hf_model.save_pretrained(folder)
