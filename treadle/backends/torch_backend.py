"""Single-process PyTorch training backend (CPU or one GPU).

AdamW, grad-norm clipping, an LR schedule, padding-free packed micro-batches under a token budget,
gradient accumulation with the loss denominator counted over the whole optimizer step, and
optional bf16 autocast (weights and optimizer state stay fp32).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from treadle.algorithms.aggregation import StepTotals
from treadle.algorithms.correction import mismatch_metrics
from treadle.algorithms.losses import token_entropy
from treadle.algorithms.objectives import Objective
from treadle.backends.packing import MicroBatch, TokenOutputs, pack, plan_micro_batches, unpack
from treadle.config import TrainerConfig
from treadle.types import TrainSample


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int):
    """Multiplier of the base LR at optimizer step ``s``: linear warmup, then the schedule."""

    def f(s: int) -> float:
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


def mean_over_steps(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """Metrics of several optimizer steps: the mean (a ``/max`` stays a maximum); the engine
    mismatch is the first step's, measured before any update of this call (with ``k``
    mini-batches, over a ``1/k`` share of the samples)."""
    totals: dict[str, float] = {}
    for stats in steps:
        for name, v in stats.items():
            if name.endswith("/max"):
                totals[name] = max(totals.get(name, v), v)
            else:
                totals[name] = totals.get(name, 0.0) + v / len(steps)
    if steps:
        totals |= {k: v for k, v in steps[0].items() if k.startswith("mismatch/")}
    return totals


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
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if trainable:
            self.optimizer = torch.optim.AdamW(
                model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lr_lambda(cfg.lr_schedule, cfg.warmup_steps, total_steps)
            )
        else:
            model.requires_grad_(False)

    def forward(self, mb: MicroBatch, entropy_grad: bool = False) -> TokenOutputs:
        """Per-token outputs ``[N]`` of a packed micro-batch, each token given the tokens before
        it in its own sequence. Position 0 of every sequence (no context) gets 0."""
        ids = mb.input_ids
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16_autocast):
            logits = self.model(
                input_ids=ids, position_ids=mb.position_ids, use_cache=False
            ).logits[0]
        is_start = mb.position_ids[0] == 0

        def shift(x: torch.Tensor) -> torch.Tensor:  # output at t-1 belongs to token t
            x = torch.cat([x.new_zeros(1), x[:-1]])
            return torch.where(is_start, torch.zeros_like(x), x)

        if self.head == "value":
            return TokenOutputs(None, None, shift(logits[:, 0].float()))
        logits = logits.float() / self.temperature
        lp = -F.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")
        lp = torch.cat([lp.new_zeros(1), lp])
        lp = torch.where(is_start, torch.zeros_like(lp), lp)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = shift(token_entropy(logits))
        return TokenOutputs(lp, entropy, None)

    def _micro_batches(self, samples: Sequence[TrainSample]) -> list[MicroBatch]:
        plan = plan_micro_batches([len(s) for s in samples], self.cfg.micro_batch_tokens)
        return [pack(samples, idx).to(self.device) for idx in plan]

    @torch.no_grad()
    def compute(
        self,
        samples: Sequence[TrainSample],
        values: bool,
        micro_batches: int = 0,
        filler: TrainSample | None = None,
    ) -> list[list[float]]:
        self.model.eval()
        out: list[list[float]] = [[] for _ in samples]
        micro = self._micro_batches(samples)
        for _ in range(micro_batches - len(micro)):  # a sharded rank joins every all-gather
            self.forward(pack([filler], [0]).to(self.device))
        for mb in micro:
            outputs = self.forward(mb)
            flat = outputs.values if values else outputs.logprobs
            for i, v in zip(mb.sample_index, unpack(flat, mb.seq_lens), strict=True):
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
        steps = [self.optimizer_step(c, objective) for c in mini_batches(samples, self.cfg)]
        totals = mean_over_steps(steps)
        tokens = sum(len(s) for s in samples)
        totals["perf/tokens_per_s"] = tokens / max(time.perf_counter() - t0, 1e-9)
        totals["perf/tokens"] = float(tokens)
        return totals

    def optimizer_step(
        self,
        samples: Sequence[TrainSample],
        objective: Objective,
        totals: StepTotals | None = None,
        micro_batches: int = 0,
        filler: TrainSample | None = None,
        loss_scale: float = 1.0,
    ) -> dict[str, float]:
        """One optimizer step over ``samples``, accumulated over packed micro-batches.

        A trainer rank of a sharded group passes the whole step's ``totals`` (the loss
        denominators), runs at least ``micro_batches`` forward/backward passes (padding with
        ``filler``, a fully masked sample, so every rank joins the same number of collectives)
        and scales its loss by ``loss_scale`` (the world size: FSDP averages gradients, the
        step-wide loss is their sum).
        """
        micro = self._micro_batches(samples)
        real = len(micro)
        if micro_batches > real:
            assert filler is not None, "padding micro-batches need a filler sample"
            micro += [pack([filler], [0]).to(self.device)] * (micro_batches - real)
        step = totals or StepTotals(
            tokens=sum(sum(s.loss_mask) for s in samples),
            sequences=sum(any(s.loss_mask) for s in samples),
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, weighted = 0.0, {}
        for i, mb in enumerate(micro):
            out = self.forward(mb, entropy_grad=objective.entropy_grad)
            if i >= real:  # padding: joins the collectives, adds nothing
                (out.logprobs if out.logprobs is not None else out.values).sum().mul(0.0).backward()
                continue
            loss, metrics = objective(out, mb, step)
            (loss * loss_scale).backward()
            loss_sum += loss.item()
            if out.logprobs is not None:
                metrics |= mismatch_metrics(out.logprobs, mb.behavior_logprobs, mb.loss_mask)
            share = float(mb.loss_mask.sum()) / step.tokens
            for name, v in metrics.items():  # token-weighted means; maxima over micro-batches
                if name.endswith("/max"):
                    weighted[name] = max(weighted.get(name, v), v)
                else:
                    weighted[name] = weighted.get(name, 0.0) + v * share
        grad_norm, lr = self.apply_gradients()
        return {
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "lr": lr,
            "perf/micro_batches": float(len(micro)),
            **weighted,
        }

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
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()
