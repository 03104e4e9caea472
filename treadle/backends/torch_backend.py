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
    def _compute(self, samples: Sequence[TrainSample], values: bool) -> list[list[float]]:
        self.model.eval()
        out: list[list[float]] = [[] for _ in samples]
        for mb in self._micro_batches(samples):
            outputs = self.forward(mb)
            flat = outputs.values if values else outputs.logprobs
            for i, v in zip(mb.sample_index, unpack(flat, mb.seq_lens), strict=True):
                out[i] = v
        return out

    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Per-token logprobs ``[L]`` (nats) of each sample under the current weights (policy)."""
        assert self.head == "lm", "compute_logprobs needs head='lm'"
        return self._compute(samples, values=False)

    def compute_values(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Per-token values ``[L]`` of each sample under the current weights (critic)."""
        assert self.head == "value", "compute_values needs head='value'"
        return self._compute(samples, values=True)

    def train_step(self, samples: Sequence[TrainSample], objective: Objective) -> dict[str, float]:
        """Split ``samples`` into ``cfg.mini_batches`` optimizer steps, each accumulated over
        packed micro-batches with the objective's aggregation over that optimizer step."""
        assert self.optimizer is not None and self.scheduler is not None, "frozen backend"
        self.model.train()
        t0 = time.perf_counter()
        k = self.cfg.mini_batches
        chunks = [[samples[i] for i in range(j, len(samples), k)] for j in range(k)]
        steps = [
            self._optimizer_step(c, objective) for c in chunks if any(any(s.loss_mask) for s in c)
        ]
        totals: dict[str, float] = {}
        for stats in steps:  # mean over the optimizer steps taken (a maximum stays a maximum)
            for name, v in stats.items():
                if name.endswith("/max"):
                    totals[name] = max(totals.get(name, v), v)
                else:
                    totals[name] = totals.get(name, 0.0) + v / len(steps)
        # Measured in the first optimizer step, before any update of this call: the old policy
        # vs the engine, over that step's samples (with k mini-batches, a 1/k share).
        if steps:
            totals |= {k: v for k, v in steps[0].items() if k.startswith("mismatch/")}
        tokens = sum(len(s) for s in samples)
        totals["perf/tokens_per_s"] = tokens / max(time.perf_counter() - t0, 1e-9)
        totals["perf/tokens"] = float(tokens)
        return totals

    def _optimizer_step(
        self, samples: Sequence[TrainSample], objective: Objective
    ) -> dict[str, float]:
        micro = self._micro_batches(samples)
        step = StepTotals(
            tokens=sum(sum(s.loss_mask) for s in samples),
            sequences=sum(any(s.loss_mask) for s in samples),
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, weighted = 0.0, {}
        for mb in micro:
            out = self.forward(mb, entropy_grad=objective.entropy_grad)
            loss, metrics = objective(out, mb, step)
            loss.backward()
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
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step applies
        self.optimizer.step()
        self.scheduler.step()
        return float(grad_norm), lr

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()
