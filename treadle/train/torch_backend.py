"""Single-process PyTorch training backend (CPU or one GPU).

AdamW, grad-norm clipping, an LR schedule, padding-free packed micro-batches under a token budget,
gradient accumulation with the loss denominator counted over the whole optimizer step, and
optional bf16 autocast (weights and optimizer state stay fp32).
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedModel

from treadle.algorithms.correction import mismatch_metrics
from treadle.config import TrainerConfig
from treadle.core.batch import MicroBatch, StepTotals, TokenOutputs
from treadle.core.metrics import Metric, Reduction, accumulate, mean_over_steps
from treadle.core.protocols import Objective, OptimizerState
from treadle.core.types import TrainSample
from treadle.train import lora
from treadle.train.checkpointing import enable_gradient_checkpointing
from treadle.train.flops import model_flops_utilisation, peak_flops
from treadle.train.packed_attention import (
    PackedAttentionUnavailable,
    packed_attention,
    windowed,
)
from treadle.train.packing import Packing, pack, plan

logger = logging.getLogger(__name__)


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int):
    """Multiplier of the base LR at optimizer step ``s``: linear warmup, then the schedule."""

    def f(s: int) -> float:
        """The LR multiplier at optimizer step ``s`` (0-based)."""
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        progress = (s - warmup_steps) / max(1, total_steps - warmup_steps)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 1.0

    return f


def mini_batches(samples: Sequence[TrainSample], cfg: TrainerConfig) -> list[list[TrainSample]]:
    """The ``cfg.mini_batches`` optimizer steps of one RL step: sample ``i`` goes to step
    ``i mod k``; a step without any trained token is dropped."""
    k = cfg.mini_batches
    chunks = [[samples[i] for i in range(j, len(samples), k)] for j in range(k)]
    return [c for c in chunks if any(any(s.loss_mask) for s in c)]


def _reshard(model: torch.nn.Module) -> None:
    """Return a sharded (FSDP2) model's parameters to their shards after a no-grad forward (a
    root module keeps its gathered parameters until the next backward otherwise, and the
    optimizer and checkpoint loading address the shards)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class TorchBackend:
    """Trains a Hugging Face model in this process: a causal-LM policy (``head="lm"``) or a
    critic (``head="value"``: a token-classification model with one output, the value).

    Args:
        model: the policy (trainable) or the frozen reference (``trainable=False``), or the
            critic.
        cfg: trainer section of the config.
        total_steps: optimizer steps planned (for the LR schedule).
        temperature: sampling temperature; logits are divided by it so trainer logprobs are
            those of the distribution the engine sampled from.
        head: ``"lm"`` (logprobs and entropy per token) or ``"value"`` (values per token).
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
        self.model = model
        self.cfg = cfg
        self.head = head
        self.temperature = temperature if temperature > 0 else 1.0
        self.device = next(model.parameters()).device
        # The output layer only where a loss reads it, when the model's forward takes
        # transformers' ``logits_to_keep``.
        # (A PEFT model forwards it to the model it wraps, whose signature tells.)
        hf = model.get_base_model() if lora.is_lora(model) else model
        self._logits_to_keep = "logits_to_keep" in inspect.signature(hf.forward).parameters
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self._tokens_computed = 0  # by the optimizer steps of one train_step (a shared prefix once)
        self._peak_flops = 0.0  # of this device in the trainer's dtype, for perf/mfu
        self._n_params = sum(p.numel() for p in model.parameters())  # N of perf/mfu's 6 N T
        if trainable:
            # measured here on a CPU (once per process), not within a step's timed update
            dtype = torch.bfloat16 if cfg.bf16_autocast else torch.float32
            self._peak_flops = peak_flops(self.device, dtype, cfg.peak_tflops)
            # Only what trains: a LoRA model's frozen base weights get no optimizer state.
            self.optimizer = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad],
                lr=cfg.lr,
                betas=cfg.betas,
                weight_decay=cfg.weight_decay,
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps)
            )
            if cfg.gradient_checkpointing:
                enable_gradient_checkpointing(model)
        else:
            model.requires_grad_(False)
        # After the optimizer holds the parameters (the probe's forward gathers a sharded
        # model's parameters; it reshards them, but the optimizer must never see the gathered).
        self.packing: Packing = self._probe_packing()
        """``shared`` (per-sample attention, a group's prompt computed once), ``plain`` (the
        model's own attention over packed samples) or ``single`` (one sample a micro-batch)."""

    def forward(
        self, mb: MicroBatch, entropy_grad: bool = False, loss_tokens_only: bool = False
    ) -> TokenOutputs:
        """Per-token outputs ``[N]`` of a packed micro-batch, each token given the tokens before
        it in its own sample (``mb.prev``). A sample's first token (no context) gets 0.

        With ``loss_tokens_only`` the output layer, log-softmax and entropy run only where
        ``mb.loss_mask`` is set (the rest stay 0): all a policy update reads, and on a prompt-
        heavy batch most of the [N, vocab] work."""
        ids = mb.input_ids[0]
        scored = mb.prev >= 0
        if loss_tokens_only and self.head == "lm":
            scored = scored & mb.loss_mask
        targets = torch.nonzero(scored).squeeze(1)  # [K] tokens to score
        sources = mb.prev[targets]  # [K] the position whose output predicts each of them
        # A shared prompt's last position predicts the first token of each of its samples, so
        # ``sources`` repeats it. Indexing with repeats backpropagates through index_put with
        # accumulate, which on CPU adds into a repeated row with atomic adds from several
        # threads in whatever order they run: the gradients' last bits then followed the
        # machine's load. The rows are kept once each (``keep``: every row written once, an
        # exact sum) and repeated by index_select, whose backward, index_add, adds in order.
        keep, rows = torch.unique(sources, return_inverse=True)  # [U], [K]: sources = keep[rows]
        if not (self.head == "lm" and self._logits_to_keep):
            keep, rows = None, sources
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16_autocast):
            out = self._model_forward(mb, keep)[0]  # [N or U, V]
        out = out.index_select(0, rows)  # [K, V]
        zeros = torch.zeros(ids.shape[0], device=out.device)
        if self.head == "value":  # the value of the state before each token
            return TokenOutputs(None, None, zeros.index_put((targets,), out[:, 0].float()))
        # One fp32 log-softmax over [K, V] serves the logprobs and the entropy (the [K, V]
        # passes, not the matmuls, are what is left to save on a large vocabulary).
        logits = out.float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        logp = torch.log_softmax(logits, -1)  # [K, V]
        lp = zeros.index_put((targets,), logp.gather(1, ids[targets, None])[:, 0])
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = zeros.index_put((targets,), -(logp.exp() * logp).sum(-1))  # H = -sum p log p
        return TokenOutputs(lp, entropy, None)

    def _model_forward(self, mb: MicroBatch, keep: torch.Tensor | None) -> torch.Tensor:
        """The model's logits ``[1, N, V]`` (``[1, len(keep), V]`` with ``keep``), attention
        computed per sample (:mod:`treadle.train.packed_attention`) when the model supports
        it, else by the model's own attention over the block-diagonal mask of position_ids."""
        kwargs = {"input_ids": mb.input_ids, "position_ids": mb.position_ids, "use_cache": False}
        if keep is not None:
            kwargs["logits_to_keep"] = keep
        call = self._forward_module()
        if self.packing == "shared" and len(mb.seq_lens) > 1:
            with packed_attention(self.model):
                return call(
                    **kwargs, packed_gather=mb.attn_gather, packed_scatter=mb.attn_scatter
                ).logits
        assert not mb.shared, "shared prefixes need the packed attention"
        return call(**kwargs).logits

    def _forward_module(self) -> torch.nn.Module:
        """What a forward pass calls: the model (a backend that wraps it, e.g. DeepSpeed's
        engine, returns the wrapper)."""
        return self.model

    @torch.no_grad()
    def _probe_packing(self) -> Packing:
        """How this model's micro-batches can be packed exactly: three tiny samples (two sharing
        a prompt) packed each way must give each sample's logits alone (computed once, in eval
        mode, so dropout cannot fail a check)."""
        vocab = getattr(self.model.config, "vocab_size", None) or 8

        def probe(ids: list[int], prompt: int, group: str) -> TrainSample:
            """A sample of ``ids`` (within the vocabulary) trained after its first ``prompt``."""
            n = len(ids)
            zeros = [0.0] * n
            return TrainSample(
                [i % vocab for i in ids], [t >= prompt for t in range(n)], zeros, zeros, 0, group
            )

        samples = [probe([1, 2, 3, 4], 2, "a"), probe([1, 2, 5], 2, "a"), probe([6, 7], 1, "b")]
        dtype = next(self.model.parameters()).dtype
        # Packing only reorders float sums (~1e-6 in fp32); a wrong layout moves logits by O(1).
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        was_training = self.model.training
        self.model.eval()
        try:
            alone = torch.cat(
                [
                    self.model(input_ids=torch.tensor([s.token_ids], device=self.device)).logits[0]
                    for s in samples
                ]
            ).float()

            def exact(packing: Packing) -> bool:
                """Whether packing the samples this way reproduces their logits alone."""
                mb = pack(samples, [0, 1, 2], share_prefix=packing == "shared").to(self.device)
                self.packing = packing
                try:
                    out = self._model_forward(mb, None)[0].float()[mb.sample_tokens]
                except (PackedAttentionUnavailable, TypeError):  # TypeError: no kwargs taken
                    return False
                return torch.allclose(out, alone, atol=tol, rtol=tol)

            if not windowed(self.model.config) and exact("shared"):
                return "shared"
            if exact("plain"):
                return "plain"
            logger.warning(
                "%s computes packed samples differently from each sample alone (its attention "
                "does not follow position_ids); training one sample per micro-batch",
                type(self.model).__name__,
            )
            return "single"
        finally:
            self.model.train(was_training)
            _reshard(self.model)

    def _micro_batches(self, samples: Sequence[TrainSample]) -> list[MicroBatch]:
        return [
            pack(samples, idx, self.packing == "shared").to(self.device)
            for idx in plan(samples, self.cfg.micro_batch_tokens, self.packing)
        ]

    @torch.no_grad()
    def compute(
        self,
        samples: Sequence[TrainSample],
        values: bool,
        micro_batches: int = 0,
        filler: TrainSample | None = None,
    ) -> list[list[float]]:
        """Per-token logprobs (nats), or critic values when ``values``, ``[L]`` per sample, in
        order, under the current weights (eval mode, no grad).

        ``micro_batches``: run at least this many forward passes, the extra ones on ``filler``
        (results dropped), so that every rank of a sharded model joins the same all-gathers.
        """
        self.model.eval()
        out: list[list[float]] = [[] for _ in samples]
        micro = self._micro_batches(samples)
        for _ in range(micro_batches - len(micro)):  # a sharded rank joins every all-gather
            self.forward(pack([filler], [0]).to(self.device))
        for mb in micro:
            outputs = self.forward(mb)
            flat = outputs.values if values else outputs.logprobs
            for i, v in zip(mb.sample_index, mb.per_sample(flat), strict=True):
                out[i] = v
        return out

    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Per-token logprobs ``[L]`` (nats) of each sample under the current weights (policy)."""
        assert self.head == "lm", "compute_logprobs needs head='lm'"
        return self.compute(samples, values=False)

    def compute_values(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Per-token values ``[L]`` of each sample under the current weights (critic)."""
        assert self.head == "value", "compute_values needs head='value'"
        return self.compute(samples, values=True)

    def train_step(self, samples: Sequence[TrainSample], objective: Objective) -> dict[str, float]:
        """Split ``samples`` into ``cfg.mini_batches`` optimizer steps, each accumulated over
        packed micro-batches with the objective's aggregation over that optimizer step."""
        assert self.optimizer is not None and self.scheduler is not None, "frozen backend"
        self.model.train()
        t0 = time.perf_counter()
        steps = [
            # the engine mismatch before any update of this call: the first step's
            self.optimizer_step(c, objective, mismatch=objective.engine_sampled and i == 0)
            for i, c in enumerate(mini_batches(samples, self.cfg))
        ]
        seconds = time.perf_counter() - t0
        tokens, self._tokens_computed = self._tokens_computed, 0
        return mean_over_steps(steps) | throughput(samples, seconds) | self.mfu(tokens, seconds)

    def mfu(self, tokens: int, seconds: float) -> dict[str, Metric]:
        """``perf/mfu``: the model FLOPs utilisation of an update that computed ``tokens``
        tokens forward and backward in ``seconds``, against this device's peak in the trainer's
        dtype (bf16 under ``bf16_autocast``, else fp32) or ``cfg.peak_tflops``
        (:mod:`treadle.train.flops`)."""
        mfu = model_flops_utilisation(self._n_params, tokens, seconds, self._peak_flops)
        return {"perf/mfu": Metric(mfu, Reduction.STEP)}

    def optimizer_step(
        self,
        samples: Sequence[TrainSample],
        objective: Objective,
        totals: StepTotals | None = None,
        micro_batches: int = 0,
        filler: TrainSample | None = None,
        loss_scale: float = 1.0,
        mismatch: bool = False,
    ) -> dict[str, Metric]:
        """One optimizer step over ``samples``, accumulated over packed micro-batches; with
        ``mismatch`` it also reports the engine/trainer logprob mismatch of the trained tokens.

        A trainer rank of a sharded group passes the whole step's ``totals`` (the loss
        denominators), runs at least ``micro_batches`` forward/backward passes (padding with
        ``filler``, a fully masked sample, so every rank joins the same number of collectives)
        and scales its loss by ``loss_scale`` (the world size: FSDP averages gradients, the
        step-wide loss is their sum).
        """
        micro = self._micro_batches(samples)
        real = len(micro)
        self._tokens_computed += sum(mb.input_ids.shape[1] for mb in micro)
        if micro_batches > real:
            assert filler is not None, "padding micro-batches need a filler sample"
            micro += [pack([filler], [0]).to(self.device)] * (micro_batches - real)
        step = totals or StepTotals(
            tokens=sum(sum(s.loss_mask) for s in samples),
            sequences=sum(any(s.loss_mask) for s in samples),
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, shares = 0.0, []
        for i, mb in enumerate(micro):
            out = self.forward(mb, objective.entropy_grad, loss_tokens_only=i < real)
            if i >= real:  # padding: joins the collectives, adds nothing
                self.backward((out.logprobs if out.logprobs is not None else out.values).sum() * 0)
                continue
            loss, metrics = objective(out, mb, step)
            self.backward(loss * loss_scale)
            loss_sum += loss.item()
            if mismatch:
                metrics |= mismatch_metrics(out.logprobs, mb.behavior_logprobs, mb.loss_mask)
            shares.append((metrics, float(mb.loss_mask.sum()) / step.tokens))
        grad_norm, lr = self.apply_gradients()
        return {
            "loss": Metric(loss_sum, Reduction.SUM),
            "grad_norm": Metric(grad_norm, Reduction.STEP),
            "lr": Metric(lr, Reduction.STEP),
            "perf/micro_batches": Metric(float(len(micro)), Reduction.SUM),
            **accumulate(shares),  # token-weighted means, maxima over the micro-batches
        }

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of a micro-batch's scalar ``loss`` (a backend that owns its
        backward pass, e.g. DeepSpeed's engine, overrides this and :meth:`apply_gradients`)."""
        loss.backward()

    def apply_gradients(self) -> tuple[float, float]:
        """Clip the accumulated gradients to ``cfg.grad_clip`` (0: no clipping), take one
        optimizer and LR-schedule step; returns the pre-clip grad norm and the LR applied."""
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):  # sharded parameters: a DTensor of the total norm
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step applies
        self.optimizer.step()
        self.scheduler.step()
        return float(grad_norm), lr

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's state dict, detached (tied weights appear under each of their names); a
        LoRA model's merged into the base model's weights (:func:`lora.engine_weights`)."""
        yield from lora.engine_weights(self.model)

    def save_pretrained(self, folder: Path) -> None:
        """The model in Hugging Face format (safetensors and config); a LoRA model's adapter
        only (PEFT format, naming the base model's folder)."""
        self.model.save_pretrained(folder)

    def optimizer_state(self) -> OptimizerState:
        """The optimizer's and LR schedule's state dicts.

        Raises:
            RuntimeError: a frozen backend (``trainable=False``) has no optimizer.
        """
        if self.optimizer is None:
            raise RuntimeError("a frozen backend has no optimizer state")
        scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
        return OptimizerState(self.optimizer.state_dict(), scheduler)

    def load_optimizer_state(self, state: OptimizerState) -> None:
        """Restore :meth:`optimizer_state`'s result; the optimizer's tensors move to the
        parameters' devices.

        Raises:
            KeyError, ValueError: the state was saved for another model or optimizer, or
                without a schedule while this backend has one.
            RuntimeError: a frozen backend.
        """
        if self.optimizer is None:
            raise RuntimeError("a frozen backend has no optimizer state")
        self.optimizer.load_state_dict(state.optimizer)
        if self.scheduler is not None:
            if state.scheduler is None:
                raise ValueError("the state was saved without an lr scheduler")
            self.scheduler.load_state_dict(state.scheduler)


def throughput(samples: Sequence[TrainSample], seconds: float) -> dict[str, Metric]:
    """``perf/tokens`` (prompt and completion tokens of the call's samples, a group's shared
    prompt counted in each) and ``perf/tokens_per_s``, those tokens per second of the update
    (the trainer's throughput; the engine's is ``perf/gen_tokens_per_s``)."""
    tokens = sum(len(s) for s in samples)
    return {
        "perf/tokens_per_s": Metric(tokens / max(seconds, 1e-9), Reduction.STEP),
        "perf/tokens": Metric(float(tokens), Reduction.SUM),
    }
