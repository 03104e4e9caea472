"""Single-process PyTorch training backend (CPU or one GPU).

AdamW, grad-norm clipping, an LR schedule, padding-free packed micro-batches under a token budget,
gradient accumulation with the loss denominator counted over the whole optimizer step, and
optional bf16 autocast (weights and optimizer state stay fp32).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from treadle.algorithms.losses import token_mean
from treadle.algorithms.objectives import Objective
from treadle.backends.packing import MicroBatch, pack, plan_micro_batches, unpack
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
    """Trains a Hugging Face causal LM in this process.

    Args:
        model: the policy (trainable) or the frozen reference (``trainable=False``).
        cfg: trainer section of the config.
        total_steps: optimizer steps planned (for the LR schedule).
        temperature: sampling temperature; logits are divided by it so trainer logprobs are
            those of the distribution the engine sampled from.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        cfg: TrainerConfig,
        total_steps: int,
        temperature: float = 1.0,
        trainable: bool = True,
    ):
        self.model = model
        self.cfg = cfg
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

    def _token_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """``[N]`` logprob of each token given the tokens before it in its own sequence."""
        ids = mb.input_ids
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16_autocast):
            logits = self.model(
                input_ids=ids, position_ids=mb.position_ids, use_cache=False
            ).logits[0]
        logits = logits[:-1].float() / self.temperature
        lp = -F.cross_entropy(logits, ids[0, 1:], reduction="none")
        lp = torch.cat([lp.new_zeros(1), lp])
        # The first token of each sequence has no context of its own: define its logprob as 0.
        is_start = mb.position_ids[0] == 0
        return torch.where(is_start, torch.zeros_like(lp), lp)

    def _micro_batches(self, samples: Sequence[TrainSample]) -> list[MicroBatch]:
        plan = plan_micro_batches([len(s) for s in samples], self.cfg.micro_batch_tokens)
        return [pack(samples, idx).to(self.device) for idx in plan]

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        self.model.eval()
        out: list[list[float]] = [[] for _ in samples]
        for mb in self._micro_batches(samples):
            for i, values in zip(
                mb.sample_index, unpack(self._token_logprobs(mb), mb.seq_lens), strict=True
            ):
                out[i] = values
        return out

    def train_step(self, samples: Sequence[TrainSample], objective: Objective) -> dict[str, float]:
        """Split ``samples`` into ``cfg.mini_batches`` optimizer steps, each accumulated over
        packed micro-batches with a token-mean over all of that optimizer step's loss tokens."""
        assert self.optimizer is not None and self.scheduler is not None, "frozen backend"
        self.model.train()
        t0 = time.perf_counter()
        k = self.cfg.mini_batches
        chunks = [[samples[i] for i in range(j, len(samples), k)] for j in range(k)]
        steps = [
            self._optimizer_step(c, objective) for c in chunks if any(any(s.loss_mask) for s in c)
        ]
        totals: dict[str, float] = {}
        for stats in steps:  # mean over the optimizer steps taken
            for name, v in stats.items():
                totals[name] = totals.get(name, 0.0) + v / len(steps)
        if steps:  # measured before any update of this call: the old policy vs the engine
            totals["mismatch/abs_logprob_diff"] = steps[0]["mismatch/abs_logprob_diff"]
        tokens = sum(len(s) for s in samples)
        totals["perf/tokens_per_s"] = tokens / max(time.perf_counter() - t0, 1e-9)
        totals["perf/tokens"] = float(tokens)
        return totals

    def _optimizer_step(
        self, samples: Sequence[TrainSample], objective: Objective
    ) -> dict[str, float]:
        num_loss_tokens = sum(sum(s.loss_mask) for s in samples)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, weighted, mismatch = 0.0, {}, 0.0
        micro = self._micro_batches(samples)
        for mb in micro:
            lp = self._token_logprobs(mb)
            per_token, metrics = objective(lp, mb)
            loss = token_mean(per_token, mb.loss_mask, float(num_loss_tokens))
            loss.backward()
            loss_sum += loss.item()
            share = float(mb.loss_mask.sum()) / num_loss_tokens
            for name, v in metrics.items():
                weighted[name] = weighted.get(name, 0.0) + v * share
            gap = (lp.detach() - mb.behavior_logprobs).abs() * mb.loss_mask
            mismatch += float(gap.sum()) / num_loss_tokens
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")  # 0: no clip
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step applies
        self.optimizer.step()
        self.scheduler.step()
        stats = {
            "loss": loss_sum,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "perf/micro_batches": float(len(micro)),
            **weighted,
        }
        stats["mismatch/abs_logprob_diff"] = mismatch
        return stats

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()
