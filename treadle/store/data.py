"""Prompts from local jsonl/parquet files or reasoning-gym, chat rendering, and the data position.

A dataset is split once into training tasks and held-out tasks; held-out prompts are
deduplicated against the training prompts so evaluation never sees a trained-on question.
A file's gold answer is its answer field, or what ``answer_pattern`` or ``answer_extract``
takes out of it; a bad row stops the load, or is skipped and counted (``skip_bad_rows``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from treadle.config import DataConfig, SourceConfig
from treadle.core.answers import after_last_hashes, answer_is, last_boxed
from treadle.core.errors import UserError
from treadle.core.plugins import is_import_path
from treadle.core.types import CodeTests, DataPosition, Message, Task
from treadle.store.data_plugins import load_tasks, loaded_split

logger = logging.getLogger(__name__)

# data.answer_extract's extractors: the gold answer in a solution text, or None.
_EXTRACTORS = {"boxed": last_boxed, "gsm8k": after_last_hashes, "answer_is": answer_is}


@dataclass(frozen=True)
class Dataset:
    """Training tasks and held-out (evaluation) tasks."""

    train: tuple[Task, ...]
    held_out: tuple[Task, ...]
    skipped: tuple[str, ...] = ()
    """The bad rows skipped under ``skip_bad_rows`` (all sources), one line each: where
    (``file:line``) and why."""


@dataclass(frozen=True)
class GoldRows:
    """Every task of a config's sources, unsplit: no held-out split, no ``size`` cap, no
    deduplication (what ``treadle reward-check`` checks), each with its raw answer."""

    tasks: tuple[Task, ...]
    raw_answers: tuple[str, ...]
    """``[len(tasks)]``: the answer field as the file holds it, before any extraction."""
    skipped: tuple[str, ...] = ()
    """The bad rows skipped under ``skip_bad_rows``, as in :attr:`Dataset.skipped`."""


@dataclass
class BadRows:
    """What becomes of a bad row of a file: a UserError naming ``file:line`` and the fix, or,
    with ``skip``, a line in ``skipped`` and the load goes on."""

    skip: bool
    key: str
    """The config key that turns skipping on (``data.skip_bad_rows``), named in the error."""
    skipped: list[str] = field(default_factory=list)

    def bad(self, where: str, why: str) -> None:
        """Record the bad row at ``where``.

        Raises:
            UserError: without ``skip``: ``where: why; ...set KEY=true to skip such rows``.
        """
        if not self.skip:
            raise UserError(
                f"{where}: {why}; fix or remove it, or set {self.key}=true to skip such rows"
            )
        self.skipped.append(f"{where}: {why}")


def load_dataset(cfg: DataConfig) -> Dataset:
    """Build the training and held-out tasks the config names, mixing in ``cfg.mix``.

    With a mix, each source contributes training prompts in proportion to its weight: source
    ``i`` gets ``round(w_i / sum(w) * N)`` of the ``N`` training prompts of all sources (cycling
    through its own when it has fewer), so a shuffled batch holds each domain in that ratio in
    expectation. Held-out prompts of every source are kept, whatever the weights.

    Raises:
        UserError: unreadable or malformed file (naming file and line), a missing field, an
            unknown reasoning-gym task, or too few prompts.
    """
    main = _load_source(cfg, "data")
    if not cfg.mix:
        return main
    parts = [(main, cfg.weight)]
    for k, (key, sub) in enumerate(_mixed_sources(cfg)):
        parts.append((_distinct_ids(_load_source(sub, key), parts, f"mix{k}"), sub.weight))
    total, weights = sum(len(d.train) for d, _ in parts), sum(w for _, w in parts)
    train: list[Task] = []
    for d, w in parts:
        count = max(1, round(w / weights * total))
        train += [d.train[i % len(d.train)] for i in range(count)]
    held_out = [t for d, _ in parts for t in d.held_out]
    skipped = tuple(line for d, _ in parts for line in d.skipped)
    return Dataset(tuple(train), tuple(held_out), skipped)


def load_gold_rows(cfg: DataConfig) -> GoldRows:
    """Every task of the config's sources (``data`` and ``data.mix``) in file order, each with
    its raw answer field: a file's rows all, whatever ``eval_size`` and ``size`` say (so a file
    smaller than the held-out split is checked whole); a reasoning-gym source's training and
    held-out tasks.

    Raises:
        UserError: as :func:`load_dataset`, except that no split is needed.
    """
    parts = [_gold_rows(cfg, "data"), *(_gold_rows(sub, key) for key, sub in _mixed_sources(cfg))]
    return GoldRows(
        tuple(t for p in parts for t in p.tasks),
        tuple(r for p in parts for r in p.raw_answers),
        tuple(line for p in parts for line in p.skipped),
    )


def _gold_rows(cfg: DataConfig, key: str) -> GoldRows:
    if is_import_path(cfg.source):  # a user's own loader: all it returns, unsplit
        tasks = load_tasks(cfg)
    elif cfg.source in ("humaneval", "mbpp"):
        tasks = _code_tasks(cfg)
    elif cfg.source == "reasoning_gym":
        train, held_out = _reasoning_gym(cfg)
        tasks = [*train, *held_out]
    else:
        return _file_rows(cfg, key)
    return GoldRows(tuple(tasks), tuple(t.answer for t in tasks))


def _mixed_sources(cfg: DataConfig) -> list[tuple[str, DataConfig]]:
    """``data.mix``'s sources, each as the main section with its fields (the same seed and
    system prompt, but no worked steps: data.reasoning is checked against the main source
    only), with its config key (``data.mix[0]``)."""
    subs = []
    for k, m in enumerate(cfg.mix):
        shared = {f.name: getattr(m, f.name) for f in dataclasses.fields(SourceConfig)}
        subs.append(
            (f"data.mix[{k}]", dataclasses.replace(cfg, **shared, reasoning="none", mix=[]))
        )
    return subs


def load_all_tasks(cfg: DataConfig) -> tuple[Task, ...]:
    """Every task of ``data.path`` and of each ``data.mix`` file, none kept for training and
    ``size``/``eval_size`` ignored: the evaluation set of ``eval.split=all`` (e.g. all 500 of
    MATH-500). Task ids are those training gives the same rows.

    Raises:
        UserError: a reasoning-gym source (it has no file to take whole), or what
            :func:`load_dataset` raises for a file.
    """
    parts: list[tuple[Dataset, float]] = []
    for k, (key, source) in enumerate([("data", cfg), *_mixed_sources(cfg)]):
        if source.source == "reasoning_gym":
            raise UserError(
                f"config eval.split=all: {key} is generated by reasoning-gym, not read from a "
                "file; use eval.split=held_out (data.eval_size prompts) for it"
            )
        whole = Dataset((), _gold_rows(source, key).tasks)  # bad rows as data.skip_bad_rows says
        parts.append((_distinct_ids(whole, parts, f"mix{k - 1}") if k else whole, 1.0))
    return tuple(t for d, _ in parts for t in d.held_out)


def _distinct_ids(data: Dataset, earlier: list[tuple[Dataset, float]], prefix: str) -> Dataset:
    """``data`` with ``prefix/`` before every task id if any of its ids is already taken by an
    earlier source (two sources of one reasoning-gym task both number theirs
    ``chain_sum/train/0, 1, ...``): a task id names one prompt's group of rollouts."""
    taken = {t.task_id for d, _ in earlier for t in (*d.train, *d.held_out)}
    if not any(t.task_id in taken for t in (*data.train, *data.held_out)):
        return data

    def _renamed(tasks: tuple[Task, ...]) -> tuple[Task, ...]:
        return tuple(dataclasses.replace(t, task_id=f"{prefix}/{t.task_id}") for t in tasks)

    return Dataset(_renamed(data.train), _renamed(data.held_out), data.skipped)


def _load_source(cfg: DataConfig, key: str) -> Dataset:
    if cfg.source in ("humaneval", "mbpp"):
        tasks = _code_tasks(cfg)
        if len(tasks) <= cfg.eval_size:
            raise UserError(
                f"data {cfg.source} {cfg.path}: {len(tasks)} tasks, too few to hold out "
                f"{cfg.eval_size}"
            )
        cut = len(tasks) - cfg.eval_size
        return Dataset(tuple(tasks[:cut][: cfg.size]), tuple(tasks[cut:]))
    skipped: tuple[str, ...] = ()
    if is_import_path(cfg.source):  # a user's own loader (treadle.store.data_plugins)
        train, held_out = loaded_split(cfg)
    elif cfg.source == "reasoning_gym":
        train, held_out = _reasoning_gym(cfg)
    else:
        rows = _file_rows(cfg, key)
        tasks, skipped = list(rows.tasks), rows.skipped
        if len(tasks) <= cfg.eval_size:
            raise UserError(
                f"{key}.path {cfg.path}: {len(tasks)} usable rows, need more than "
                f"{key}.eval_size={cfg.eval_size} (the held-out split); add data or lower it"
            )
        held_out = tasks[-cfg.eval_size :] if cfg.eval_size else []
        train = tasks[: len(tasks) - cfg.eval_size][: cfg.size]
        seen = {t.messages for t in train}
        held_out = [t for t in held_out if t.messages not in seen]
    if not train:
        raise UserError(f"{key}: the dataset ({cfg.source} {cfg.path or cfg.task}) is empty")
    return Dataset(tuple(train), tuple(held_out), skipped)


def _code_tasks(cfg: DataConfig) -> list[Task]:
    """HumanEval (``HumanEval.jsonl.gz``) or MBPP (``sanitized-mbpp.json``) as code tasks: the
    gold answer is the canonical solution in a fenced block (what a demonstration shows), the
    payload holds the tests the ``code`` reward runs."""
    import ast
    import gzip

    path = Path(cfg.path or "")
    if not path.is_file():
        raise UserError(f"data.path {path}: file not found (a {cfg.source} file)")
    try:
        if cfg.source == "humaneval":
            with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as f:
                rows = [json.loads(line) for line in f if line.strip()]
        else:
            rows = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"data.path {path}: not a {cfg.source} file ({e})") from None

    def listed(value: Any) -> list[str]:  # MBPP copies stringify their list columns
        """``value`` as a list: parsed as a Python literal when it is a string."""
        return ast.literal_eval(value) if isinstance(value, str) else list(value)

    tasks = []
    for i, r in enumerate(rows):
        if cfg.source == "humaneval":
            question = f"Complete this Python function:\n```python\n{r['prompt']}```"
            solution = r["prompt"] + r["canonical_solution"]
            # The model writes the whole function (the prompt is in its demonstration).
            tests = CodeTests("", (f"{r['test']}\ncheck({r['entry_point']})",))
        else:
            asserts = listed(r["test_list"])
            question = f"{r['prompt']}\nYour code should pass this test:\n{asserts[0]}"
            solution = r["code"]
            tests = CodeTests("\n".join(listed(r["test_imports"])), tuple(asserts))
        tasks.append(
            Task(
                task_id=f"{cfg.source}/{r.get('task_id', i)}",
                messages=_messages(cfg, question),
                answer=f"```python\n{solution.rstrip()}\n```",
                domain=cfg.domain,
                payload=tests.to_payload(),
            )
        )
    return tasks


def _messages(cfg: DataConfig, question: str) -> tuple[Message, ...]:
    system = (Message("system", cfg.system_prompt),) if cfg.system_prompt else ()
    return (*system, Message("user", question))


def _reasoning_gym(cfg: DataConfig) -> tuple[list[Task], list[Task]]:
    import reasoning_gym

    def make(size: int, seed: int) -> list[dict[str, Any]]:
        """``size`` reasoning-gym entries of ``cfg.task``; UserError on bad task parameters."""
        try:
            return list(
                reasoning_gym.create_dataset(cfg.task, size=size, seed=seed, **cfg.task_params)
            )
        except (ValueError, TypeError, AssertionError, KeyError) as e:
            raise UserError(
                f"data.task {cfg.task} with data.task_params {cfg.task_params}: {e}"
            ) from None

    def task(entry: dict[str, Any], split: str, i: int) -> Task:
        """The ``i``-th entry of ``split`` as a task (the entry itself is the reward payload)."""
        payload = json.dumps({"dataset": cfg.task, "entry": entry}, default=list)
        return Task(
            task_id=f"{cfg.task}/{split}/{i}",
            messages=_messages(cfg, entry["question"]),
            answer=str(entry["answer"]),
            domain=cfg.domain,
            payload=payload,
            reasoning=_reasoning(cfg, entry),
        )

    train = [task(e, "train", i) for i, e in enumerate(make(cfg.size, cfg.seed))]
    seen = {t.messages for t in train}
    # Held-out prompts come from another seed; oversample, then drop trained-on questions.
    pool = make(cfg.eval_size * 4 + 16, cfg.seed + 1_000_003) if cfg.eval_size else []
    held_out: list[Task] = []
    for i, e in enumerate(pool):
        t = task(e, "eval", i)
        if t.messages not in seen and len(held_out) < cfg.eval_size:
            seen.add(t.messages)
            held_out.append(t)
    return train, held_out


def _reasoning(cfg: DataConfig, entry: dict[str, Any]) -> str:
    if cfg.reasoning == "none":
        return ""
    expression = entry.get("metadata", {}).get("expression")
    if not isinstance(expression, str):
        raise UserError(f"data.reasoning=chain_steps: task {cfg.task} has no metadata.expression")
    return chain_steps(expression)


def chain_steps(expression: str) -> str:
    """Left-to-right worked steps of a chain of ``+``/``-`` on integers.

    ``"4 - 1 - 7"`` -> ``"4 - 1 = 3, 3 - 7 = -4."``

    Raises:
        UserError: the expression holds another operator.
    """
    parts = expression.split()
    if len(parts) < 3 or len(parts) % 2 == 0 or any(op not in "+-" for op in parts[1::2]):
        raise UserError(f"data.reasoning=chain_steps: {expression!r} is not a +/- chain")
    total, steps = int(parts[0]), []
    for op, operand in zip(parts[1::2], parts[2::2], strict=True):
        new = total + int(operand) if op == "+" else total - int(operand)
        steps.append(f"{total} {op} {operand} = {new}")
        total = new
    return ", ".join(steps) + "."


def render_demonstration(task: Task, template: str, answer: str | None = None) -> str:
    """An SFT demonstration of ``task`` in ``template`` (fields ``{reasoning}``, ``{answer}``)."""
    return template.format(
        reasoning=task.reasoning, answer=task.answer if answer is None else answer
    )


def read_rows(
    path: Path, source: str, key: str = "data.path", bad_rows: BadRows | None = None
) -> list[tuple[dict[str, Any], str]]:
    """The JSON objects of a jsonl file (or the rows of a parquet file), each with where it came
    from (``file:line``) for error messages. A malformed line goes to ``bad_rows`` when given
    (skipped or raised there).

    Raises:
        UserError: naming ``key`` (the config key that gave the path) for a missing or unreadable
            file, and ``file:line`` for a malformed line.
    """
    if not path.is_file():
        what = "a directory, not a file" if path.is_dir() else "file not found"
        raise UserError(f"{key} {path}: {what}")
    if source == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises several types for a bad file
            raise UserError(f"{key} {path}: not a readable parquet file: {e}") from None
        return [(row, f"{path} row {i}") for i, row in enumerate(table.to_pylist())]
    rows = []
    # Line by line, so that a line that is not UTF-8 is one bad row at file:line (skippable).
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not raw.strip():
            continue
        row, why = _json_object(raw, "utf-8-sig" if lineno == 1 else "utf-8")  # a BOM first
        if why is None:
            rows.append((row, f"{path}:{lineno}"))
        elif bad_rows is None:
            raise UserError(f"{path}:{lineno}: {why}; fix or remove it")
        else:
            bad_rows.bad(f"{path}:{lineno}", why)
    return rows


def _json_object(raw: bytes, encoding: str) -> tuple[dict[str, Any], None] | tuple[None, str]:
    """One jsonl line as ``(row, None)``, or ``(None, why)`` when it is not a JSON object in
    UTF-8 text."""
    try:
        row = json.loads(raw.decode(encoding))
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text ({e.reason} at byte {e.start} of the line)"
    except json.JSONDecodeError as e:
        return None, f"malformed JSON line ({e.msg})"
    if not isinstance(row, dict):
        return None, "expected a JSON object per line"
    return row, None


@functools.cache
def _answer_regex(pattern: str, key: str) -> re.Pattern[str]:
    try:
        regex = re.compile(pattern, flags=re.MULTILINE)
    except re.error as e:
        raise UserError(f"{key}.answer_pattern {pattern!r}: not a valid regex ({e})") from None
    if regex.groups < 1:
        raise UserError(f"{key}.answer_pattern {pattern!r}: needs a group (...) around the answer")
    return regex


def _file_rows(cfg: DataConfig, key: str) -> GoldRows:
    """The tasks of a jsonl/parquet source, in file order, with their raw answer fields; bad
    rows raised or skipped (``{key}.skip_bad_rows``), the skipped ones logged."""
    bad = BadRows(cfg.skip_bad_rows, f"{key}.skip_bad_rows")
    tasks, raw_answers = [], []
    for row, where in read_rows(Path(cfg.path or ""), cfg.source, f"{key}.path", bad):
        missing = [
            f"no field {col!r} ({key}.{name}); fields are {sorted(row)}"
            for name, col in (
                ("question_field", cfg.question_field),
                ("answer_field", cfg.answer_field),
            )
            if col not in row
        ]
        if missing:
            bad.bad(where, missing[0])
            continue
        raw = str(row[cfg.answer_field])
        answer = _gold_answer(cfg, key, raw, where, bad)
        if answer is None:
            continue
        task_id = f"{Path(cfg.path or '').stem}/{len(tasks)}"
        question = str(row[cfg.question_field])
        tasks.append(Task(task_id, _messages(cfg, question), answer=answer, domain=cfg.domain))
        raw_answers.append(raw)
    if bad.skipped:
        logger.warning(
            "%s: skipped %d bad rows (%s=true), the first: %s",
            cfg.path,
            len(bad.skipped),
            bad.key,
            bad.skipped[0],
        )
    return GoldRows(tuple(tasks), tuple(raw_answers), tuple(bad.skipped))


def _gold_answer(cfg: DataConfig, key: str, raw: str, where: str, bad: BadRows) -> str | None:
    """The gold answer in a row's answer field ``raw``: all of it, or what ``answer_pattern``
    or ``answer_extract`` takes out (stripped, ``1,000`` -> ``1000``); None for a bad row (one
    where nothing, or nothing but blanks, is taken out), recorded in ``bad``."""
    if cfg.answer_pattern:
        m = _answer_regex(cfg.answer_pattern, key).search(raw)
        if not m:
            bad.bad(where, f"answer does not match {key}.answer_pattern {cfg.answer_pattern!r}")
            return None
        answer, how = (m.group(1) or "").strip(), f"{key}.answer_pattern"
    elif cfg.answer_extract != "none":
        found = _EXTRACTORS[cfg.answer_extract](raw)
        how = f"{key}.answer_extract={cfg.answer_extract}"
        if found is None:
            bad.bad(where, f"{how} finds no answer in field {cfg.answer_field!r}")
            return None
        answer = found
    else:
        return raw
    if not answer:
        bad.bad(where, f"{how} takes an empty answer out of field {cfg.answer_field!r}")
        return None
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", answer):  # "1,000" -> "1000"
        answer = answer.replace(",", "")
    return answer


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Prompt token ids ``[P]``: the chat template over the task's messages, ready for a reply,
    with ``template_kwargs`` (``data.chat_template_kwargs``, e.g. ``{"enable_thinking": False}``
    for Qwen3) as extra variables of the template."""
    text = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in task.messages],
        add_generation_prompt=True,
        tokenize=False,
        **(template_kwargs or {}),
    )
    return tokenizer.encode(text, add_special_tokens=False)


class TaskSampler:
    """Draws training tasks in a seeded shuffle per epoch; its position is part of the run state."""

    def __init__(self, tasks: tuple[Task, ...], seed: int, position: DataPosition | None = None):
        self._tasks = tasks
        self._seed = seed
        self.position = DataPosition(**vars(position)) if position else DataPosition()
        self._order = self._shuffle(self.position.epoch)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self._tasks)))
        random.Random(self._seed * 1_000_003 + epoch).shuffle(order)
        return order

    def task_at(self, position: DataPosition) -> Task:
        """The task this sampler draws next when at ``position`` (its state is unchanged).

        Raises:
            ValueError: the offset is past the end of an epoch of these tasks.
        """
        if position.offset > len(self._tasks):
            raise ValueError(f"offset {position.offset} is past the {len(self._tasks)} tasks")
        return TaskSampler(self._tasks, self._seed, position).next_batch(1)[0]

    def next_batch(self, k: int) -> list[Task]:
        """The next ``k`` tasks; crossing an epoch boundary reshuffles."""
        batch = []
        while len(batch) < k:
            if self.position.offset >= len(self._order):
                self.position = DataPosition(self.position.epoch + 1, 0)
                self._order = self._shuffle(self.position.epoch)
            batch.append(self._tasks[self._order[self.position.offset]])
            self.position.offset += 1
        return batch
