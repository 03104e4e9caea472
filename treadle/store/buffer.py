"""The rollout buffer: every trained rollout, addressed by rollout id, persisted as parquet.

Each RL step's rollouts are written to ``RUN/buffer/step_NNNNNN.parquet`` (atomically: a
temporary file, fsync, rename) when the step's update is done, one row per rollout with the
task, the texts, the reward and every per-token array the update used (token ids, loss mask,
behavior/old/reference logprobs, values, advantages, returns). That is enough to read a step
back (``treadle inspect RUN --step N``) and to replay its update exactly
(:mod:`treadle.jobs.inspect_run`).

A rollout id is ``"{step:06d}-{group:04d}-{sample:03d}"``: the step, the group's position in the
step's batch and the sample's position in its group. The buffer refuses a second rollout with
an id it holds, so a retried request can never be stored twice.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from treadle.core.types import RolloutGroup, TrainSample
from treadle.store.atomic import write_bytes_atomic

BUFFER_DIRNAME = "buffer"
_STEP_FILE = re.compile(r"^step_(\d{6})\.parquet$")
_FLOATS = pa.list_(pa.float64())  # float64 holds the float32 values the update used exactly

SCHEMA = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("step", pa.int32()),
        ("group", pa.int32()),
        ("sample", pa.int32()),
        ("task_id", pa.string()),
        ("domain", pa.string()),
        ("messages", pa.string()),  # JSON list of {role, content}
        ("completion", pa.string()),
        ("reward", pa.float64()),
        ("correct", pa.bool_()),
        ("grader_failed", pa.bool_()),
        ("finish_reason", pa.string()),
        ("policy_version", pa.int32()),
        ("token_versions", pa.list_(pa.int32())),  # [R]: the policy version of each sampled token
        ("prompt_tokens", pa.int32()),
        ("token_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.bool_())),
        ("behavior_logprobs", _FLOATS),
        ("advantages", _FLOATS),
        ("ref_logprobs", _FLOATS),
        ("old_logprobs", _FLOATS),
        ("values", _FLOATS),
        ("returns", _FLOATS),
    ]
)
"""One row per rollout; per-token lists are ``[L]`` over prompt + completion tokens, except
``token_versions``, ``[R]`` over the completion (``policy_version`` is their minimum; files
written before it existed read back without it)."""


def rollout_id(step: int, group: int, sample: int) -> str:
    """The id of sample ``sample`` of group ``group`` (positions in the batch) of ``step``."""
    return f"{step:06d}-{group:04d}-{sample:03d}"


class DuplicateRolloutError(ValueError):
    """A rollout id is already stored."""


@dataclass(frozen=True)
class StoredStep:
    """A step read back from the buffer."""

    step: int
    rows: list[dict]
    """One dict per rollout with the columns of :data:`SCHEMA`, in batch order."""

    @property
    def samples(self) -> list[TrainSample]:
        """The train samples the step's update used, in batch order."""
        return [
            TrainSample(
                token_ids=row["token_ids"],
                loss_mask=row["loss_mask"],
                behavior_logprobs=row["behavior_logprobs"],
                advantages=row["advantages"],
                policy_version=row["policy_version"],
                group_id=row["task_id"],
                ref_logprobs=row["ref_logprobs"],
                old_logprobs=row["old_logprobs"],
                values=row["values"],
                returns=row["returns"],
            )
            for row in self.rows
        ]


class RolloutBuffer:
    """Rollouts by rollout id in ``RUN/buffer``, one parquet file per step.

    Opening a buffer reads the ids of the steps already stored (a resumed run); a step stored
    again (a run resumed from a checkpoint before it) replaces its file, and steps after a
    resume point are dropped by :meth:`truncate_after`.

    Args:
        run_dir: the run directory; files go to ``run_dir/buffer``.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.root = Path(run_dir) / BUFFER_DIRNAME
        self.root.mkdir(parents=True, exist_ok=True)
        self._ids: dict[str, int] = {}  # rollout id -> step
        for step in self.steps():
            for rid in pq.read_table(self.path(step), columns=["rollout_id"]).column(0):
                self._ids[rid.as_py()] = step

    def path(self, step: int) -> Path:
        """The parquet file of ``step`` (``RUN/buffer/step_NNNNNN.parquet``; may not exist)."""
        return self.root / f"step_{step:06d}.parquet"

    def steps(self) -> list[int]:
        """Steps stored, ascending."""
        found = (_STEP_FILE.match(p.name) for p in self.root.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def __contains__(self, rid: str) -> bool:
        return rid in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def truncate_after(self, step: int) -> None:
        """Forget steps after ``step`` (a run resumed from the checkpoint of ``step``)."""
        for s in self.steps():
            if s > step:
                self.path(s).unlink()
        self._ids = {rid: s for rid, s in self._ids.items() if s <= step}

    def add(
        self, step: int, groups: Sequence[RolloutGroup], samples: Sequence[TrainSample]
    ) -> Path:
        """Store ``step``'s rollouts (``samples[i]`` is the i-th rollout of ``groups`` in order).

        Raises:
            ValueError: ``samples`` do not match ``groups`` one to one.
            DuplicateRolloutError: a rollout id of this step is already stored by another step,
                or the batch holds the same id twice.
        """
        self._drop_step(step)  # a step stored again (after a resume) replaces its file
        rows = []
        flat = [(gi, si, g, r) for gi, g in enumerate(groups) for si, r in enumerate(g.rollouts)]
        if len(flat) != len(samples):
            raise ValueError(f"buffer: {len(flat)} rollouts but {len(samples)} train samples")
        for (gi, si, g, r), s in zip(flat, samples, strict=True):
            rid = rollout_id(step, gi, si)
            if rid in self._ids:
                raise DuplicateRolloutError(f"rollout {rid} is already in the buffer")
            rows.append(
                {
                    "rollout_id": rid,
                    "step": step,
                    "group": gi,
                    "sample": si,
                    "task_id": g.task.task_id,
                    "domain": g.task.domain,
                    "messages": json.dumps(
                        [{"role": m.role, "content": m.content} for m in g.task.messages]
                    ),
                    "completion": r.completion.text,
                    "reward": r.reward,
                    "correct": r.correct,
                    "grader_failed": r.grader_failed,
                    "finish_reason": str(r.completion.finish_reason),
                    "policy_version": s.policy_version,
                    "token_versions": list(r.completion.versions()),
                    "prompt_tokens": len(g.prompt_token_ids),
                    "token_ids": s.token_ids,
                    "loss_mask": s.loss_mask,
                    "behavior_logprobs": s.behavior_logprobs,
                    "advantages": s.advantages,
                    "ref_logprobs": s.ref_logprobs,
                    "old_logprobs": s.old_logprobs,
                    "values": s.values,
                    "returns": s.returns,
                }
            )
        out = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), out)
        path = write_bytes_atomic(self.path(step), out.getvalue().to_pybytes())
        self._ids.update((row["rollout_id"], step) for row in rows)
        return path

    def read_step(self, step: int) -> StoredStep:
        """The rollouts of ``step``.

        Raises:
            FileNotFoundError: the step is not stored (the message lists the stored steps).
        """
        path = self.path(step)
        if not path.is_file():
            stored = self.steps()
            where = f"steps {stored[0]}..{stored[-1]}" if stored else "no steps"
            raise FileNotFoundError(f"{self.root} holds {where}, not step {step}")
        return StoredStep(step, pq.read_table(path).to_pylist())

    def get(self, rid: str) -> dict:
        """One rollout's row by id.

        Raises:
            KeyError: no rollout has this id.
        """
        if rid not in self._ids:
            raise KeyError(f"no rollout {rid!r} in {self.root}")
        return next(r for r in self.read_step(self._ids[rid]).rows if r["rollout_id"] == rid)

    def _drop_step(self, step: int) -> None:
        if self.path(step).exists():
            self.path(step).unlink()
        self._ids = {rid: s for rid, s in self._ids.items() if s != step}
