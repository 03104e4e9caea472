"""``treadle dpo``: Direct Preference Optimization of the policy on preference pairs against the
frozen starting model as reference (Rafailov et al., arXiv:2305.18290).

With ``sft.steps > 0`` the SFT warm-up of ``treadle train`` runs first and DPO starts from its
checkpoint (which is also the reference). Pairs come from ``dpo.path`` (a jsonl; about 10% are
held out) or are synthesised from the reasoning-gym data (the gold demonstration is chosen, the
same with a wrong answer rejected; the held-out pairs come from the held-out tasks).

Run directory (``run.output_dir/run.name``)::

    config.yaml        the resolved config
    base_model/        the built tiny model + tokenizer (when model.path is unset)
    sft/, sft_model/   the SFT warm-up's metrics and checkpoint (when sft.steps > 0)
    dpo/               metrics.jsonl and TensorBoard events: one line per optimizer step, plus
                       the held-out evaluation (eval/...) at step 0 and at the last step
    dpo_model/         the policy after DPO (Hugging Face format)
    dpo_summary.json   held-out reward margin and accuracies before and after DPO
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from transformers import PreTrainedTokenizerBase

from treadle.algorithms.losses import segment_sum
from treadle.algorithms.preference import dpo_loss
from treadle.config import Config, DPOConfig, NoiseConfig
from treadle.core.errors import UserError
from treadle.core.types import Message, Task, TrainSample
from treadle.jobs.compose import base_model, prepare_run_dir, seed_everything
from treadle.jobs.sft import noisy_demonstration, warm_up
from treadle.store.atomic import save_model_atomic, write_json_atomic
from treadle.store.data import Dataset, load_dataset, read_rows, render_demonstration, render_prompt
from treadle.store.models import IM_END, end_of_turn_ids, load_model, require_model_folder
from treadle.store.observe import MetricsLogger, Progress
from treadle.train import lora
from treadle.train.backends import build_backend, in_one_process
from treadle.train.packing import pack, plan_micro_batches
from treadle.train.torch_backend import TorchBackend


@dataclass(frozen=True)
class PreferencePair:
    """One prompt with a preferred (chosen) and a dispreferred (rejected) response, as text."""

    task: Task
    """The prompt (``task.messages``); ``task.task_id`` says where the pair came from
    (``file:line``, or the reasoning-gym task id)."""
    chosen: str
    rejected: str


@dataclass(frozen=True)
class PairSplit:
    """The preference pairs of a DPO run, split into those trained on and those held out."""

    train: list[PreferencePair]
    held_out: list[PreferencePair]
    """Never trained on; the reward margin and accuracies before and after are measured here."""


@dataclass(frozen=True)
class PairSamples:
    """A tokenized pair: both samples hold the same prompt tokens (``loss_mask`` False), then
    their response and the end-of-turn token (``loss_mask`` True)."""

    chosen: TrainSample
    rejected: TrainSample

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


@dataclass(frozen=True)
class PairLogprobs:
    """Sequence logprobs (nats, summed over the responses' trained tokens) of ``B`` pairs."""

    chosen: torch.Tensor  # [B]
    rejected: torch.Tensor  # [B]


# ----------------------------------------------------------------------------- pairs


def read_pairs(cfg: DPOConfig) -> list[PreferencePair]:
    """Preference pairs of the jsonl ``cfg.path``, one JSON object per line.

    Raises:
        UserError: the file is missing, a line is not a JSON object, or lacks a field or has one
            of the wrong type (naming ``file:line`` and the ``dpo.*_field`` key), or fewer than
            two pairs (one is held out).
    """
    path = Path(cfg.path or "")
    if not path.is_file():
        what = "a directory, not a file" if path.is_dir() else "file not found"
        raise UserError(
            f"dpo.path {path}: {what}; give a jsonl of preference pairs, or leave dpo.path unset "
            "to synthesise pairs from the reasoning-gym data"
        )
    pairs = [_file_pair(cfg, row, where) for row, where in read_rows(path, "jsonl", key="dpo.path")]
    if len(pairs) < 2:
        raise UserError(
            f"dpo.path {path}: {len(pairs)} preference pairs; need at least 2 (one is held out)"
        )
    return pairs


def _file_pair(cfg: DPOConfig, row: dict[str, Any], where: str) -> PreferencePair:
    keys = (
        ("prompt_field", cfg.prompt_field),
        ("chosen_field", cfg.chosen_field),
        ("rejected_field", cfg.rejected_field),
    )
    for key, name in keys:
        if name not in row:
            raise UserError(f"{where}: no field {name!r} (dpo.{key}); fields are {sorted(row)}")
    for key, name in keys[1:]:
        if not isinstance(row[name], str):
            raise UserError(f"{where}: field {name!r} (dpo.{key}) must be a string")
    prompt = row[cfg.prompt_field]
    if isinstance(prompt, str):
        messages = (Message("user", prompt),)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in prompt
        )
    ):
        messages = tuple(Message(m["role"], m["content"]) for m in prompt)
    else:
        raise UserError(
            f"{where}: field {cfg.prompt_field!r} (dpo.prompt_field) must be a string or a list "
            "of {role, content} messages"
        )
    task = Task(task_id=where, messages=messages, answer="", domain="")
    return PreferencePair(task, row[cfg.chosen_field], row[cfg.rejected_field])


def synthesise_pairs(
    tasks: Sequence[Task], answer_template: str, seed: int
) -> list[PreferencePair]:
    """Chosen: the gold demonstration in ``answer_template``; rejected: the same with the answer
    off by 1 to 3 (as :func:`treadle.jobs.sft.noisy_demonstration` makes it). Tasks whose answer is
    not an integer give no pair (no wrong answer can be made)."""
    wrong = NoiseConfig(wrong_answer_fraction=1.0)
    pairs = []
    for t in tasks:
        chosen = render_demonstration(t, answer_template)
        rejected = noisy_demonstration(t, wrong, answer_template, seed)
        if rejected != chosen:
            pairs.append(PreferencePair(t, chosen, rejected))
    return pairs


def load_pairs(cfg: Config, data: Dataset | None) -> PairSplit:
    """The training and held-out pairs: ``dpo.path`` with a seeded ~10% held out, or synthesised
    from ``data`` (its held-out tasks give the held-out pairs).

    Raises:
        UserError: as :func:`read_pairs`, or no pair could be synthesised.
    """
    if cfg.dpo.path is not None:
        pairs = read_pairs(cfg.dpo)
        random.Random(cfg.run.seed).shuffle(pairs)
        held = max(1, len(pairs) // 10)
        return PairSplit(train=pairs[held:], held_out=pairs[:held])
    assert data is not None, "synthesised pairs need the dataset"
    template, seed = cfg.data.answer_template, cfg.run.seed
    split = PairSplit(
        train=synthesise_pairs(data.train, template, seed),
        held_out=synthesise_pairs(data.held_out, template, seed),
    )
    if not split.train or not split.held_out:
        raise UserError(
            "dpo.path: unset, and no preference pairs can be synthesised from the data (their "
            "answers must be integers and data.answer_template must hold {answer}, for training "
            "and held-out tasks); give pairs in a jsonl with dpo.path=FILE"
        )
    return split


def pair_samples(
    pairs: Sequence[PreferencePair],
    tokenizer: PreTrainedTokenizerBase,
    max_len: int,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[PairSamples]:
    """Tokenize each pair: prompt (chat template, with the extra variables ``template_kwargs``)
    + response + end-of-turn token.

    Raises:
        UserError: a sample is longer than ``max_len`` (the model's context), naming the pair.
    """
    ids = end_of_turn_ids(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    eot = im_end if im_end in ids else ids[0]  # the chat template ends a turn with <|im_end|>

    def sample(pair: PreferencePair, prompt: list[int], text: str) -> TrainSample:
        """``prompt`` + ``text``'s tokens + end-of-turn, trained on the response only; raises
        UserError over ``max_len`` tokens."""
        reply = [*tokenizer.encode(text, add_special_tokens=False), eot]
        n = len(prompt) + len(reply)
        if n > max_len:
            raise UserError(
                f"dpo: pair {pair.task.task_id} is {n} tokens, over the model's context of "
                f"{max_len}; shorten or remove it"
            )
        return TrainSample(
            token_ids=prompt + reply,
            loss_mask=[False] * len(prompt) + [True] * len(reply),
            behavior_logprobs=[0.0] * n,
            advantages=[0.0] * n,
            policy_version=0,
            group_id=pair.task.task_id,
        )

    out = []
    for p in pairs:
        prompt = render_prompt(tokenizer, p.task, template_kwargs)
        out.append(PairSamples(sample(p, prompt, p.chosen), sample(p, prompt, p.rejected)))
    return out


# ----------------------------------------------------------------------------- logprobs


def sequence_logprobs(backend: TorchBackend, pairs: Sequence[PairSamples]) -> PairLogprobs:
    """Sequence logprobs ``[B]`` of the pairs under the backend's current weights, no grad."""
    samples = [s for p in pairs for s in (p.chosen, p.rejected)]
    per_token = backend.compute_logprobs(samples)
    sums = torch.tensor(
        [
            sum(lp for lp, m in zip(lps, s.loss_mask, strict=True) if m)
            for lps, s in zip(per_token, samples, strict=True)
        ]
    )
    return PairLogprobs(chosen=sums[0::2], rejected=sums[1::2])


class ReferenceLogprobs:
    """Sequence logprobs of the training pairs under the frozen reference, each pair computed the
    first time a batch draws it and kept (the reference never changes)."""

    def __init__(self, reference: TorchBackend, pairs: Sequence[PairSamples]):
        self._reference = reference
        self._pairs = pairs
        self._cache: dict[int, tuple[float, float]] = {}

    def of(self, indices: Sequence[int]) -> PairLogprobs:
        """Reference sequence logprobs ``[len(indices)]`` (nats) of the training pairs at
        ``indices``, in that order (repeats allowed); computes only the uncached ones."""
        new = [i for i in dict.fromkeys(indices) if i not in self._cache]
        if new:
            lp = sequence_logprobs(self._reference, [self._pairs[i] for i in new])
            for i, c, r in zip(new, lp.chosen.tolist(), lp.rejected.tolist(), strict=True):
                self._cache[i] = (c, r)
        return PairLogprobs(
            chosen=torch.tensor([self._cache[i][0] for i in indices]),
            rejected=torch.tensor([self._cache[i][1] for i in indices]),
        )


# ----------------------------------------------------------------------------- training


def dpo_step(
    policy: TorchBackend, batch: Sequence[PairSamples], ref: PairLogprobs, beta: float
) -> dict[str, float]:
    """One optimizer step on ``batch``; the loss is the mean over its pairs.

    Pairs are packed into micro-batches of at most ``trainer.micro_batch_tokens`` tokens (a
    longer pair gets one of its own), each pair's chosen and rejected sample in the same one, so
    that each micro-batch's loss is complete; gradients accumulate over the micro-batches.
    """
    assert policy.optimizer is not None and policy.scheduler is not None, "frozen backend"
    policy.model.train()
    policy.optimizer.zero_grad(set_to_none=True)
    samples = [s for p in batch for s in (p.chosen, p.rejected)]
    ref_chosen, ref_rejected = ref.chosen.to(policy.device), ref.rejected.to(policy.device)
    chosen, rejected = torch.zeros(len(batch)), torch.zeros(len(batch))  # detached, for metrics
    plan = plan_micro_batches([len(p) for p in batch], policy.cfg.micro_batch_tokens)
    for pair_index in plan:
        mb = pack(samples, [j for i in pair_index for j in (2 * i, 2 * i + 1)]).to(policy.device)
        lp = policy.forward(mb).logprobs
        seq = segment_sum(torch.where(mb.loss_mask, lp, 0.0), mb.segments)  # [2k] c, r, c, r...
        idx = torch.tensor(pair_index, device=policy.device)
        loss, _ = dpo_loss(seq[0::2], seq[1::2], ref_chosen[idx], ref_rejected[idx], beta)
        policy.backward(loss.sum() / len(batch))
        chosen[pair_index] = seq[0::2].detach().cpu()
        rejected[pair_index] = seq[1::2].detach().cpu()
    grad_norm, lr = policy.apply_gradients()
    loss, metrics = dpo_loss(chosen, rejected, ref.chosen, ref.rejected, beta)
    return {
        "loss": float(loss.mean()),
        **metrics,
        "grad_norm": grad_norm,
        "lr": lr,
        "perf/micro_batches": float(len(plan)),
    }


def evaluate_pairs(
    policy: TorchBackend, pairs: Sequence[PairSamples], ref: PairLogprobs, beta: float
) -> dict[str, float]:
    """Held-out DPO loss, reward margin and reward accuracy, and ``preference_accuracy``: the
    fraction of pairs whose chosen response the policy gives a higher logprob than the rejected
    (unlike the reward accuracy, not 0 by construction before training)."""
    lp = sequence_logprobs(policy, pairs)
    loss, m = dpo_loss(lp.chosen, lp.rejected, ref.chosen, ref.rejected, beta)
    return {
        "eval/loss": float(loss.mean()),
        "eval/reward_margin": m["dpo/reward_margin"],
        "eval/reward_accuracy": m["dpo/reward_accuracy"],
        "eval/preference_accuracy": float((lp.chosen > lp.rejected).float().mean()),
    }


def _batches(num_pairs: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Endless batches of pair indices: a seeded shuffle per epoch (batches straddle epochs)."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        while len(order) < batch_size:
            fresh = list(range(num_pairs))
            rng.shuffle(fresh)
            order += fresh
        yield order[:batch_size]
        order = order[batch_size:]


def run_dpo(cfg: Config, console: Console | None = None) -> Path:
    """The ``treadle dpo`` job; returns the folder of the trained policy (``RUN/dpo_model``).

    Raises:
        UserError: bad pairs (see :func:`load_pairs`), a missing model folder, or a pair longer
            than the model's context.
    """
    console = console or Console()
    started = time.perf_counter()
    torch.set_num_threads(cfg.run.threads)
    seed_everything(cfg.run.seed)
    if cfg.model.path is not None:
        require_model_folder(cfg.model.path)
    data = None
    if cfg.dpo.path is None or cfg.model.path is None or cfg.sft.steps > 0:
        data = load_dataset(cfg.data)  # pairs to synthesise, a tokenizer to train, or SFT data
    pairs = load_pairs(cfg, data)  # bad input fails here, before a run directory exists
    run_dir = prepare_run_dir(cfg, None)
    start = Path(cfg.model.path) if data is None else base_model(cfg, data, run_dir)
    if cfg.sft.steps > 0:  # as in `treadle train`: SFT warm-up first, DPO from its checkpoint
        start = warm_up(cfg, data, start, run_dir, console)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model(start, "float32")  # fp32 master weights, as in RL
    if cfg.model.lora.r > 0:  # the reference is the same model with its adapters disabled
        model = lora.apply_lora(model, cfg.model.lora)
    max_len = model.config.max_position_embeddings
    kwargs = cfg.data.chat_template_kwargs
    train = pair_samples(pairs.train, tokenizer, max_len, kwargs)
    held_out = pair_samples(pairs.held_out, tokenizer, max_len, kwargs)
    trainer = dataclasses.replace(in_one_process(cfg.trainer), lr=cfg.dpo.lr)  # this process
    policy = build_backend(model.to(device), trainer, total_steps=cfg.dpo.steps)
    if cfg.model.lora.r > 0:
        reference = lora.AdapterDisabledReference(policy)
    else:
        ref_model, _ = load_model(start, "float32")
        reference = build_backend(ref_model.to(device), trainer, 1, trainable=False)
    before, after = _train_and_evaluate(cfg, policy, reference, train, held_out, run_dir, console)
    folder = save_model_atomic(lora.exported(policy), tokenizer, run_dir / "dpo_model")
    summary = _summary(cfg, len(train), len(held_out), before, after, started)
    write_json_atomic(run_dir / "dpo_summary.json", summary)
    _print_summary(console, summary)
    return folder


def _train_and_evaluate(
    cfg: Config,
    policy: TorchBackend,
    reference: TorchBackend,
    train: Sequence[PairSamples],
    held_out: Sequence[PairSamples],
    run_dir: Path,
    console: Console,
) -> tuple[dict[str, float], dict[str, float]]:
    """The ``dpo.steps`` optimizer steps, logged to ``RUN/dpo``; returns the held-out
    evaluation (:func:`evaluate_pairs`) before the first step and after the last."""
    ref_train = ReferenceLogprobs(reference, train)
    ref_held_out = sequence_logprobs(reference, held_out)
    beta = cfg.dpo.beta

    metrics = MetricsLogger(run_dir / "dpo")
    try:
        before = evaluate_pairs(policy, held_out, ref_held_out, beta)
        metrics.log(0, before)
        console.print(
            f"DPO: {cfg.dpo.steps} steps of {cfg.dpo.batch_size} pairs "
            f"({len(train)} training pairs, {len(held_out)} held out), beta {beta}"
        )
        batches = _batches(len(train), cfg.dpo.batch_size, cfg.run.seed)
        with Progress(cfg.dpo.steps, console=console) as bar:
            for step in range(1, cfg.dpo.steps + 1):
                t0 = time.perf_counter()
                index = next(batches)
                m = dpo_step(policy, [train[i] for i in index], ref_train.of(index), beta)
                m["time/step_s"] = time.perf_counter() - t0
                metrics.log(step, m)
                bar.update(step, loss=m["loss"], step_time_s=m["time/step_s"])
        after = evaluate_pairs(policy, held_out, ref_held_out, beta)
        metrics.log(cfg.dpo.steps, after)
    finally:
        metrics.close()
    return before, after


def _summary(
    cfg: Config,
    train_pairs: int,
    held_out_pairs: int,
    before: dict[str, float],
    after: dict[str, float],
    started: float,
) -> dict[str, float | int]:
    """What ``dpo_summary.json`` holds: the run's size, each held-out metric before and after
    DPO (``<name>_before``, ``<name>_after``) and the wall time (seconds) since ``started``
    (a ``time.perf_counter()`` reading)."""
    summary: dict[str, float | int] = {
        "dpo_steps": cfg.dpo.steps,
        "train_pairs": train_pairs,
        "held_out_pairs": held_out_pairs,
    }
    for when, values in (("before", before), ("after", after)):
        summary |= {f"{k.removeprefix('eval/')}_{when}": v for k, v in values.items()}
    summary["wall_time_s"] = time.perf_counter() - started
    return summary


def _print_summary(console: Console, s: dict[str, float | int]) -> None:
    console.print(f"held-out pairs ({s['held_out_pairs']}), before -> after DPO:")
    for name, fmt in (
        ("preference_accuracy", ".1%"),
        ("reward_accuracy", ".1%"),
        ("reward_margin", ".3f"),
        ("loss", ".4f"),
    ):
        before, after = s[f"{name}_before"], s[f"{name}_after"]
        console.print(f"  {name.replace('_', ' ')}: {before:{fmt}} -> {after:{fmt}}")
