"""A learned reward model: a local Hugging Face sequence-classification model scores completions.

The model (``AutoModelForSequenceClassification`` with ``num_labels=1``, e.g. a Bradley-Terry
reward model as in InstructGPT, Ouyang et al. 2022, arXiv:2203.02155, eq. 1) reads the prompt and
the completion rendered with *its own* tokenizer's chat template (a tokenizer without one gets the
pair ``(prompt, completion)``, as encoder reward models are trained), and its one output logit is
the reward: read at the last real token for decoder classifiers, from the pooled first token for
BERT-like encoders; any other architecture is run one sequence at a time so that padding cannot
change its score. Rewards are unitless; a Bradley-Terry model's scores are meaningful up to a
constant, so compare them, or use ``weight`` to scale them against the other functions.

Unlike the rule-based verifiers it is batched: the pool calls :meth:`RewardModelReward.score_batch`
once per batch with every sample routed to it, and the model scores them ``batch_size`` at a time,
sorted by length so that little padding is computed.

Placement (``params.placement``):

- ``colocated``: the model lives in the calling (trainer) process on ``device``, sharing its memory
  and threads; nothing is copied between processes, but a hang cannot be stopped.
- ``separate`` (default): the model lives in one dedicated worker process on ``device`` (another
  GPU, e.g. ``cuda:1``, or the CPU with its own ``threads``); each batch is one call bounded by
  ``timeout_s`` per forward pass. A batch that times out or kills the worker raises here (the
  pool gives its samples the fallback reward and counts them), and the next batch gets a new
  worker that loads the model again.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import multiprocessing
import time
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from treadle.core.errors import UserError
from treadle.core.types import Task
from treadle.rewards.base import Score
from treadle.rewards.params import float_param, int_param

PLACEMENTS = ("colocated", "separate")
_DTYPES = ("float32", "bfloat16")
_LOAD_TIMEOUT_S = 600.0  # a fresh separate worker may take this long to load the model


def _check_device(device: str) -> None:
    """Refuse a device string torch cannot use here (before any run directory exists)."""
    if device in ("cpu", "auto"):
        return
    if device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise UserError(f"reward_model: device must be cpu, cuda, cuda:N or auto: {device!r}")
    import torch

    index = int(device[5:]) if device.startswith("cuda:") else 0
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise UserError(
            f"reward_model: device {device} is not available ({seen} GPUs visible); use "
            "device: cpu or auto"
        )


def _context_length(config) -> int | None:
    """The most positions the model can read, from its config (None: unbounded or unknown)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class RewardModelReward:
    """Score ``(task, response)`` pairs with the sequence-classification model in ``path``.

    Args:
        path: a local folder holding the model (``config.json`` with ``num_labels: 1``, weights)
            and its tokenizer.
        device: where the model runs: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (``cuda`` when
            a GPU is visible, else ``cpu``).
        placement: ``colocated`` (in the calling process) or ``separate`` (its own process).
        batch_size: sequences per forward pass.
        max_length: tokens per sequence, capped to the model's context; longer ones lose their
            *beginning* (the tokenizer truncates on the left), so the completion's end, where a
            decoder's score is read, is kept.
        dtype: ``float32`` or ``bfloat16`` (float16 is refused: unusable on CPUs). In bfloat16 a
            score can move by one bfloat16 step with the batch it was computed in.
        threshold: a sample is counted ``correct`` (for accuracy metrics only) when its reward is
            ``>= threshold``.
        timeout_s: wall-clock limit of one forward pass of ``batch_size`` sequences in the
            ``separate`` process, in seconds (a call of N samples may take
            ``ceil(N / batch_size) * timeout_s``).
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
        batch_size: int = 16,
        max_length: int = 2048,
        dtype: str = "float32",
        threshold: float = 0.0,
        timeout_s: float = 300.0,
        threads: int = 1,
    ) -> None:
        if not path:
            raise UserError("reward_model: set params.path to a local reward-model folder")
        if placement not in PLACEMENTS:
            raise UserError(f"reward_model: placement must be one of {PLACEMENTS}: {placement!r}")
        if dtype not in _DTYPES:
            raise UserError(f"reward_model: dtype must be one of {_DTYPES}, got {dtype!r}")
        self.batch_size = int_param(batch_size, "reward_model: batch_size")
        self.max_length = int_param(max_length, "reward_model: max_length")
        self.threshold = float_param(threshold, "reward_model: threshold")
        self.timeout_s = float_param(timeout_s, "reward_model: timeout_s")
        self.threads = int_param(threads, "reward_model: threads")
        if not (math.isfinite(self.threshold) and math.isfinite(self.timeout_s)):
            raise UserError("reward_model: threshold and timeout_s must be finite numbers")
        if self.batch_size < 1 or self.max_length < 2 or self.timeout_s <= 0 or self.threads < 0:
            raise UserError(
                "reward_model: need batch_size >= 1, max_length >= 2, timeout_s > 0, threads >= 0"
            )
        _check_device(device)
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise UserError(f"reward_model: {folder} is not a model folder (no config.json)")
        if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
            raise UserError(f"reward_model: {folder} holds no weights (*.safetensors or *.bin)")
        from transformers import AutoConfig, AutoTokenizer

        try:
            config = AutoConfig.from_pretrained(folder)
            AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, KeyError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"reward_model: cannot load {folder}: {first}") from None
        if config.num_labels != 1:
            raise UserError(
                f"reward_model: {folder} has num_labels={config.num_labels}; a reward model "
                "outputs one score (num_labels: 1 in its config.json)"
            )
        context = _context_length(config)
        if context is not None:  # never feed the model more positions than it has
            self.max_length = min(self.max_length, context)
        self.path, self.device, self.placement, self.dtype = str(folder), device, placement, dtype
        self._scorer: _Scorer | None = None  # colocated: loaded on first use
        self._worker = None  # separate: a pebble pool of one process, started on first use

    def score(self, task: Task, response: str) -> Score:
        """One sample (the pool calls :meth:`score_batch`; this is for single checks)."""
        return self.score_batch([(task, response)])[0]

    def score_batch(
        self, samples: Sequence[tuple[Task, str]], timeout_s: float = math.inf
    ) -> list[Score]:
        """``[N]`` scores of ``samples``, in order, within ``timeout_s`` seconds (the pool
        passes the time left to its batch's deadline).

        ``separate``: the batch is killed after the smaller of ``timeout_s`` and
        ``params.timeout_s`` per forward (a fresh worker's model load is not charged to it, so
        the first batch may overrun). ``colocated``: a forward cannot be stopped, but none is
        started after ``timeout_s`` has passed.

        Raises:
            TimeoutError: the batch ran past its limit.
            RuntimeError: ``separate`` placement, the worker died or could not load the model.
        """
        if not samples:
            return []
        deadline = time.monotonic() + timeout_s
        conversations = [_conversation(task, response) for task, response in samples]
        if self.placement == "colocated":
            if self._scorer is None:
                self._scorer = _Scorer(self._settings())
            rewards = self._scorer.rewards(conversations, deadline)
        else:
            rewards = self._run_separate(conversations, timeout_s)
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

    def _run_separate(
        self, conversations: list[list[dict[str, str]]], timeout_s: float
    ) -> list[float]:
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
        chunks = -(-len(conversations) // self.batch_size)
        # self.timeout_s bounds each forward of batch_size sequences; timeout_s, the call
        limit = min(self.timeout_s * chunks, timeout_s)
        try:
            return future.result(timeout=limit)
        except TimeoutError:
            future.cancel()  # pebble kills the worker; the pool starts a new one
            self.close()
            raise TimeoutError(
                f"reward_model: {len(conversations)} samples ({chunks} forwards of up to "
                f"{self.batch_size}) took over {limit:.1f} s ({self.timeout_s} s a forward, "
                f"{timeout_s:.1f} s for the call)"
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
        if self.tokenizer.pad_token_id is None and self.tokenizer.eos_token is not None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.pad_id = self.tokenizer.pad_token_id or 0
        dtype = getattr(torch, settings["dtype"])
        self.model = AutoModelForSequenceClassification.from_pretrained(
            settings["path"], dtype=dtype
        ).to(self.device)
        self.model.eval()
        self.mode = _scoring_mode(self.model)
        # Encoders that tell the prompt from the response by segment get token type ids.
        forward = inspect.signature(self.model.forward).parameters
        self.token_types = self.mode != "last" and "token_type_ids" in forward

    def encode(self, conversations: list[list[dict[str, str]]]) -> list[dict[str, list[int]]]:
        """Token ids (and token type ids, for encoders that use them) of each conversation:
        rendered with the model's chat template, or else as the pair (prompt, response) the way
        encoder reward models are trained (``[CLS] prompt [SEP] response [SEP]``)."""
        if self.tokenizer.chat_template:
            texts = [self.tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
            enc = self.tokenizer(
                texts, truncation=True, max_length=self.max_length, add_special_tokens=False
            )
        else:
            prompts = ["\n".join(m["content"] for m in c[:-1]) for c in conversations]
            responses = [c[-1]["content"] for c in conversations]
            enc = self.tokenizer(
                prompts,
                responses,
                truncation="longest_first",
                max_length=self.max_length,
                return_token_type_ids=self.token_types,
            )
        keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
        rows = [{k: list(enc[k][i]) for k in keys} for i in range(len(conversations))]
        for row in rows:  # an empty text: one pad token
            if not row["input_ids"]:
                row.update({k: [0] for k in keys} | {"input_ids": [self.pad_id]})
        return rows

    def rewards(
        self, conversations: list[list[dict[str, str]]], deadline: float = math.inf
    ) -> list[float]:
        """``[N]`` rewards, scored ``batch_size`` sequences at a time, longest first.

        Raises:
            TimeoutError: a forward was due after ``deadline`` (a :func:`time.monotonic` time).
        """
        import torch

        rows = self.encode(conversations)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]), reverse=True)
        size = self.batch_size if self.mode != "alone" else 1
        rewards = [0.0] * len(rows)
        with torch.inference_mode():
            for start in range(0, len(order), size):
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"reward_model: the deadline passed after {start} of {len(rows)} samples"
                    )
                chunk = order[start : start + size]
                width = max(len(rows[i]["input_ids"]) for i in chunk)
                batch = {
                    k: torch.full((len(chunk), width), self.pad_id if k == "input_ids" else 0)
                    for k in rows[chunk[0]]
                }
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for r, i in enumerate(chunk):
                    n = len(rows[i]["input_ids"])
                    for k, values in rows[i].items():
                        batch[k][r, :n] = torch.tensor(values)
                    mask[r, :n] = 1
                batch = {k: v.to(self.device) for k, v in batch.items()}
                values = self._forward(batch, mask.to(self.device))
                for i, value in zip(chunk, values, strict=True):
                    rewards[i] = value
        return rewards

    def _forward(self, batch: dict, mask) -> list[float]:
        """``[B]`` rewards of right-padded ``batch["input_ids"]`` ``[B, T]``."""
        import torch

        if self.mode == "last":
            # Decoder reward models (a ``score`` head over every position): read each sequence
            # at its own last real token, found from the mask (HF's forward finds it from
            # pad-token ids, which goes wrong when the text itself ends with the pad token).
            hidden = self.model.base_model(
                input_ids=batch["input_ids"], attention_mask=mask
            ).last_hidden_state
            final = hidden[torch.arange(len(mask), device=hidden.device), mask.sum(dim=1) - 1]
            return self.model.score(final).float().squeeze(-1).cpu().tolist()
        # Encoders pooling their first token ignore right padding under the attention mask;
        # anything else is scored one sequence at a time ("alone": no padding at all).
        logits = self.model(**batch, attention_mask=mask).logits
        return logits[:, 0].float().cpu().tolist()


def _scoring_mode(model) -> str:
    """How to read a model's reward: ``last`` (a decoder with a ``score`` head: the last real
    token), ``pooled`` (an encoder that pools its first token: padded batches are safe) or
    ``alone`` (anything else: one sequence per forward, so padding cannot change a score)."""
    import torch

    if isinstance(getattr(model, "score", None), torch.nn.Linear):  # HF's decoder classifiers
        return "last"
    if model.config.model_type in _FIRST_TOKEN_POOLING:
        return "pooled"
    return "alone"


_FIRST_TOKEN_POOLING = {
    "bert", "roberta", "xlm-roberta", "deberta", "deberta-v2", "distilbert", "electra",
    "albert", "camembert", "modernbert", "mpnet",
}  # fmt: skip


_WORKER_SCORER: _Scorer | None = None
_WORKER_SETTINGS: dict = {}


def _load_worker(settings: dict) -> None:
    """Worker initializer: set threads and remember the settings (the model loads in
    :func:`_ready`, so a load error reaches the parent with its message)."""
    global _WORKER_SETTINGS
    import torch

    if settings["threads"] > 0:
        torch.set_num_threads(settings["threads"])
    _WORKER_SETTINGS = settings


def _ready() -> None:
    """Load the model once; raises what loading raised."""
    global _WORKER_SCORER
    if _WORKER_SCORER is None:
        _WORKER_SCORER = _Scorer(_WORKER_SETTINGS)


def _worker_rewards(conversations: list[list[dict[str, str]]]) -> list[float]:
    _ready()
    return _WORKER_SCORER.rewards(conversations)
