"""A learned reward model: a local Hugging Face sequence-classification model scores completions.

The model (``AutoModelForSequenceClassification`` with ``num_labels=1``, e.g. a Bradley-Terry
reward model as in InstructGPT, Ouyang et al. 2022, arXiv:2203.02155, eq. 1) reads the prompt and
the completion rendered with *its own* tokenizer's chat template, and its one output logit at the
last token is the reward (unitless; a Bradley-Terry model's scores are meaningful up to a
constant, so compare them, or use ``weight`` to scale them against the other functions).

Unlike the rule-based verifiers it is batched: the pool calls :meth:`RewardModelReward.score_batch`
once per batch with every sample routed to it, and the model scores them ``batch_size`` at a time,
sorted by length so that little padding is computed.

Placement (``params.placement``):

- ``colocated``: the model lives in the calling (trainer) process on ``device``, sharing its memory
  and threads; nothing is copied between processes, but a hang cannot be stopped.
- ``separate`` (default): the model lives in one dedicated worker process on ``device`` (another
  GPU, e.g. ``cuda:1``, or the CPU with its own ``threads``); each batch is one call with a
  wall-clock ``timeout_s``. A batch that times out or kills the worker raises here (the pool gives
  its samples the fallback reward and counts them), and the next batch gets a new worker that
  loads the model again.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from treadle.errors import UserError
from treadle.rewards.base import Score
from treadle.types import Task

PLACEMENTS = ("colocated", "separate")
_DTYPES = ("float32", "bfloat16")
_LOAD_TIMEOUT_S = 600.0  # a fresh separate worker may take this long to load the model


class RewardModelReward:
    """Score ``(task, response)`` pairs with the sequence-classification model in ``path``.

    Args:
        path: a local folder holding the model (``config.json`` with ``num_labels: 1``, weights)
            and its tokenizer.
        device: where the model runs: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (``cuda`` when
            a GPU is visible, else ``cpu``).
        placement: ``colocated`` (in the calling process) or ``separate`` (its own process).
        batch_size: sequences per forward pass.
        max_length: tokens per sequence; longer ones lose their *beginning* (the tokenizer
            truncates on the left), so the completion's end, where the score is read, is kept.
        dtype: ``float32`` or ``bfloat16`` (float16 is refused: unusable on CPUs).
        threshold: a sample is counted ``correct`` (for accuracy metrics only) when its reward is
            ``>= threshold``.
        timeout_s: wall-clock limit of one batch in the ``separate`` process, in seconds.
        threads: torch CPU threads of the ``separate`` process (0: torch's default).

    Raises:
        UserError: a bad argument, a missing folder, or a model that is not a one-output
            sequence classifier (all checked at construction, before any weights are loaded).
    """

    name = "reward_model"

    def __init__(
        self,
        path: str = "",
        device: str = "cpu",
        placement: str = "separate",
        batch_size: str = "16",
        max_length: str = "2048",
        dtype: str = "float32",
        threshold: str = "0",
        timeout_s: str = "300",
        threads: str = "1",
    ) -> None:
        if not path:
            raise UserError("reward_model: set params.path to a local reward-model folder")
        if placement not in PLACEMENTS:
            raise UserError(f"reward_model: placement must be one of {PLACEMENTS}: {placement!r}")
        if dtype not in _DTYPES:
            raise UserError(f"reward_model: dtype must be one of {_DTYPES}, got {dtype!r}")
        if not (device in ("cpu", "cuda", "auto") or device.startswith("cuda:")):
            raise UserError(f"reward_model: device must be cpu, cuda, cuda:N or auto: {device!r}")
        try:
            self.batch_size, self.max_length = int(batch_size), int(max_length)
            self.threshold, self.timeout_s = float(threshold), float(timeout_s)
            self.threads = int(threads)
        except ValueError:
            raise UserError(
                "reward_model: batch_size, max_length, threads must be integers and threshold, "
                "timeout_s numbers"
            ) from None
        if self.batch_size < 1 or self.max_length < 2 or self.timeout_s <= 0 or self.threads < 0:
            raise UserError(
                "reward_model: need batch_size >= 1, max_length >= 2, timeout_s > 0, threads >= 0"
            )
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise UserError(f"reward_model: {folder} is not a model folder (no config.json)")
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder)
        if config.num_labels != 1:
            raise UserError(
                f"reward_model: {folder} has num_labels={config.num_labels}; a reward model "
                "outputs one score (num_labels: 1 in its config.json)"
            )
        self.path, self.device, self.placement, self.dtype = str(folder), device, placement, dtype
        self._scorer: _Scorer | None = None  # colocated: loaded on first use
        self._worker = None  # separate: a pebble pool of one process, started on first use

    def score(self, task: Task, response: str) -> Score:
        """One sample (the pool calls :meth:`score_batch`; this is for single checks)."""
        return self.score_batch([(task, response)])[0]

    def score_batch(self, samples: Sequence[tuple[Task, str]]) -> list[Score]:
        """``[N]`` scores of ``samples``, in order.

        Raises:
            TimeoutError: ``separate`` placement, the batch ran past ``timeout_s``.
            RuntimeError: ``separate`` placement, the worker died or could not load the model.
        """
        if not samples:
            return []
        conversations = [_conversation(task, response) for task, response in samples]
        if self.placement == "colocated":
            if self._scorer is None:
                self._scorer = _Scorer(self._settings())
            rewards = self._scorer.rewards(conversations)
        else:
            rewards = self._run_separate(conversations)
        if len(rewards) != len(samples) or not all(math.isfinite(r) for r in rewards):
            raise RuntimeError(f"reward_model: want {len(samples)} finite scores, got {rewards}")
        return [Score(reward=r, correct=r >= self.threshold) for r in rewards]

    def close(self) -> None:
        """Stop the separate worker (a running batch is killed); free the colocated model."""
        if self._worker is not None:
            self._worker.stop()
            self._worker.join()
            self._worker = None
        self._scorer = None

    def worker_pid(self) -> int | None:
        """The process id of the ``separate`` worker (None: colocated, or not started)."""
        if self._worker is None or not self._worker.active:
            return None
        import os

        return self._worker.schedule(os.getpid).result(timeout=_LOAD_TIMEOUT_S)

    def _settings(self) -> dict:
        return {
            "path": self.path,
            "device": self.device,
            "dtype": self.dtype,
            "batch_size": self.batch_size,
            "max_length": self.max_length,
            "threads": self.threads,
        }

    def _run_separate(self, conversations: list[list[dict[str, str]]]) -> list[float]:
        import pebble

        if self._worker is None or not self._worker.active:
            if self._worker is not None:
                self._worker.join()
            self._worker = pebble.ProcessPool(
                max_workers=1,
                initializer=_load_worker,
                initargs=(self._settings(),),
                context=multiprocessing.get_context("spawn"),
            )
            # A fresh worker loads the model first; that is not charged to a batch's timeout.
            try:
                self._worker.schedule(_ready).result(timeout=_LOAD_TIMEOUT_S)
            except Exception as error:
                self.close()
                raise RuntimeError(
                    f"reward_model: the worker could not load {self.path} on {self.device} "
                    f"({type(error).__name__}: {error})"
                ) from None
        future = self._worker.schedule(_worker_rewards, args=(conversations,))
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError:
            future.cancel()  # pebble kills the worker; the pool starts a new one
            self.close()
            raise TimeoutError(
                f"reward_model: a batch of {len(conversations)} took over {self.timeout_s} s"
            ) from None
        except (pebble.ProcessExpired, BrokenProcessPool) as error:
            self.close()
            raise RuntimeError(f"reward_model: the worker process died ({error})") from None

    def __getstate__(self) -> dict:
        # Configuration only: a copy (e.g. in another process) loads its own model.
        return {**self.__dict__, "_scorer": None, "_worker": None}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _conversation(task: Task, response: str) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in task.messages] + [
        {"role": "assistant", "content": response}
    ]


class _Scorer:
    """The loaded model and tokenizer; scores conversations in length-sorted batches."""

    def __init__(self, settings: dict) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        device = settings["device"]
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.batch_size, self.max_length = settings["batch_size"], settings["max_length"]
        self.tokenizer = AutoTokenizer.from_pretrained(settings["path"])
        self.tokenizer.truncation_side = "left"  # keep the completion's end, where the score is
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype = getattr(torch, settings["dtype"])
        self.model = AutoModelForSequenceClassification.from_pretrained(
            settings["path"], dtype=dtype
        ).to(self.device)
        self.model.eval()

    def texts(self, conversations: list[list[dict[str, str]]]) -> list[str]:
        """Each conversation rendered with the model's chat template (or joined by newlines)."""
        if self.tokenizer.chat_template:
            return [self.tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
        return ["\n".join(m["content"] for m in c) for c in conversations]

    def rewards(self, conversations: list[list[dict[str, str]]]) -> list[float]:
        import torch

        ids = self.tokenizer(
            self.texts(conversations),
            truncation=True,
            max_length=self.max_length,
            # A chat template writes its own special tokens; plain text gets the tokenizer's.
            add_special_tokens=not self.tokenizer.chat_template,
        )["input_ids"]
        ids = [row or [self.tokenizer.pad_token_id] for row in ids]  # an empty text: one pad
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
        rewards = [0.0] * len(ids)
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                width = max(len(ids[i]) for i in chunk)
                input_ids = torch.zeros((len(chunk), width), dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for row, i in enumerate(chunk):
                    input_ids[row, : len(ids[i])] = torch.tensor(ids[i])
                    mask[row, : len(ids[i])] = 1
                values = self._forward(input_ids.to(self.device), mask.to(self.device))
                for i, value in zip(chunk, values, strict=True):
                    rewards[i] = value
        return rewards

    def _forward(self, input_ids, mask) -> list[float]:
        """``[B]`` rewards of right-padded ``input_ids`` ``[B, T]`` with ``mask`` ``[B, T]``."""
        import torch

        head = getattr(self.model, "score", None)
        if head is None:  # encoder classifiers (BERT-like) pool on their own: use their forward
            logits = self.model(input_ids=input_ids, attention_mask=mask).logits
            return logits[:, 0].float().cpu().tolist()
        # Decoder reward models (``score`` head over every position): read each sequence at its
        # own last real token, found from the mask; HF's forward finds it from pad-token ids,
        # which goes wrong when the text itself ends with the pad token.
        hidden = self.model.base_model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        last = mask.sum(dim=1) - 1
        final = hidden[torch.arange(len(input_ids), device=hidden.device), last]
        return head(final).float().squeeze(-1).cpu().tolist()


_WORKER_SCORER: _Scorer | None = None


def _load_worker(settings: dict) -> None:
    """Worker initializer: set threads, load the model once."""
    global _WORKER_SCORER
    import torch

    if settings["threads"] > 0:
        torch.set_num_threads(settings["threads"])
    _WORKER_SCORER = _Scorer(settings)


def _ready() -> None:
    """Nothing; returns once the worker's initializer has loaded the model."""


def _worker_rewards(conversations: list[list[dict[str, str]]]) -> list[float]:
    if _WORKER_SCORER is None:
        raise RuntimeError("reward_model worker has no model loaded")
    return _WORKER_SCORER.rewards(conversations)
