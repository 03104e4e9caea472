"""Atomic checkpoints of a run: the policy's (and a critic's) weights and optimizer state, the RNG
states and the run state, in one directory per saved step.

Layout under a run directory ``RUN``::

    RUN/checkpoints/
        latest                   text file: name of the newest complete checkpoint, e.g. step_000040
        step_000040/
            model/               Hugging Face format (safetensors, config, tokenizer files)
            trainer_state.pt     optimizer and lr-scheduler state dicts, RNG states
            state.json           the run state (:class:`RunState`): schema version, step, policy
                                 version, data position
            critic/              a PPO critic (Hugging Face format), when the run has one
            critic_state.pt      its optimizer and lr-scheduler state dicts
            manifest.json        every file's size and SHA-256, written last

What a resume needs, and where it is: the policy's weights (``model/``), its optimizer and LR
schedule, every random generator (Python, numpy, torch CPU and CUDA: the in-process engines
sample from torch's) in ``trainer_state.pt``; the step, the policy version, the data sampler's
position and an asynchronous run's drawn-but-untrained prompts in ``state.json``. The rows
logged so far (``metrics.jsonl``), the stored rollouts (``buffer/``) and the evaluation before RL
(``before_rl.json``) live beside the checkpoints and are cut back to its step on resume.

A checkpoint is written into a hidden sibling ``.tmp_step_*`` directory, every file is fsynced,
the manifest is written last, and the directory is renamed into place with :func:`os.replace`
(atomic on one filesystem). Free space is checked first (the last checkpoint's size).
``latest`` is rewritten the same way, only after the new directory is in place. So a crash at any
moment leaves either the old state or the new one: never a half-written ``step_*`` directory, and
never a ``latest`` that names a missing directory. Leftover ``.tmp_*`` entries from a crash are
removed by the next save. On resume, :func:`resume_checkpoint` verifies the newest checkpoint
against its manifest and falls back to the newest older one that verifies (logged).

The trainers are :class:`~treadle.core.protocols.Checkpointable` (every training backend is):
the checkpoint asks them for their weights and optimizer state and gives the state back on
resume. Model weights are loaded by the caller: ``from_pretrained(ckpt / "model")``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treadle.core.errors import UserError
from treadle.core.protocols import Checkpointable, OptimizerState
from treadle.core.types import DataPosition
from treadle.store.atomic import (
    TMP_PREFIX,
    PretrainedSaver,
    fsync_dir,
    fsync_tree,
    replace_dir,
    write_text_atomic,
)
from treadle.store.manifest import (
    CorruptCheckpointError,
    disk_full_error,
    is_disk_full,
    require_free_space,
    tree_bytes,
    verify_manifest,
    write_manifest,
)
from treadle.store.rng import capture_rng_state, restore_rng_state

logger = logging.getLogger(__name__)

CHECKPOINTS_DIRNAME = "checkpoints"
LATEST_FILENAME = "latest"
MODEL_DIRNAME = "model"
TRAINER_STATE_FILENAME = "trainer_state.pt"
STATE_FILENAME = "state.json"
CRITIC_DIRNAME = "critic"
CRITIC_STATE_FILENAME = "critic_state.pt"
_STEP_DIR_RE = re.compile(r"^step_(\d{6,})$")

RUN_STATE_VERSION = 3
"""Schema version of ``state.json`` written now. Version 1 (the first, also written before the
field existed) holds ``step``, ``policy_version`` and ``data_position``; version 2 adds
``pending`` (asynchronous rollouts' prompts drawn and not trained); version 3 has the same
fields and promises a ``manifest.json`` beside it (a version-3 checkpoint without one is
damaged; an older one is loaded unverified)."""
MANIFEST_SINCE = 3


@dataclass(frozen=True)
class RunState:
    """Where a run is when a checkpoint is saved: what ``state.json`` holds."""

    step: int
    """RL steps done (names the directory ``step_{step:06d}``)."""
    policy_version: int
    """Version of the policy's weights: RL steps (weight syncs) since the start of RL."""
    data_position: DataPosition
    """The task sampler's position, so the resumed run draws the same next prompts."""
    schema_version: int = RUN_STATE_VERSION
    pending: tuple[DataPosition, ...] = ()
    """Sampler positions of the prompts an asynchronous run had drawn and not trained (running
    or waiting for the trainer): the resumed run generates them again first (schema 2; empty
    in schema 1 and in ``rollout.mode=sync``)."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to ``state.json``."""
        position = {"epoch": self.data_position.epoch, "offset": self.data_position.offset}
        return {
            "schema_version": self.schema_version,
            "step": self.step,
            "policy_version": self.policy_version,
            "data_position": position,
            "pending": [{"epoch": p.epoch, "offset": p.offset} for p in self.pending],
        }

    @classmethod
    def from_json(cls, raw: Any, path: Path) -> RunState:
        """Read ``state.json``'s object (of any schema version this code reads).

        Raises:
            UserError: a schema version newer than :data:`RUN_STATE_VERSION` (the message
                names both), or a missing or mistyped field (naming ``path``).
        """
        version = raw.get("schema_version", 1) if isinstance(raw, dict) else None
        if version is not None and (not _count(version) or version < 1):
            raise UserError(
                f"{path}: schema_version {version!r} is not a schema version (an integer >= 1); "
                "resume from an earlier checkpoint or start without --resume"
            )
        if isinstance(version, int) and version > RUN_STATE_VERSION:
            raise UserError(
                f"{path}: run state schema version {version}, but this treadle reads versions up "
                f"to {RUN_STATE_VERSION}; resume with the treadle that wrote it (or a newer one)"
            )
        problem = "not an object" if not isinstance(raw, dict) else ""
        if not problem:
            position = raw.get("data_position")
            fields = [raw.get("step"), raw.get("policy_version"), version]
            if isinstance(position, dict):
                fields += [position.get("epoch"), position.get("offset")]
            else:
                problem = "no data_position object"
            pending = raw.get("pending", [])
            if isinstance(pending, list) and all(isinstance(p, dict) for p in pending):
                fields += [p.get(k) for p in pending for k in ("epoch", "offset")]
            else:
                problem = "pending is not a list of positions"
            if not all(_count(v) for v in fields):
                problem = problem or "a missing, negative or non-integer field"
            elif not problem and not _drawn_in_order(pending, position):
                problem = "pending positions not in draw order before data_position"
        if problem:
            raise UserError(
                f"{path} is not a checkpoint state ({problem}; expected integers >= 0: step, "
                "policy_version and data_position.epoch/offset); resume from an earlier "
                "checkpoint or start without --resume"
            )
        return cls(
            step=raw["step"],
            policy_version=raw["policy_version"],
            data_position=DataPosition(position["epoch"], position["offset"]),
            schema_version=version,
            pending=tuple(DataPosition(p["epoch"], p["offset"]) for p in pending),
        )


def _drawn_in_order(pending: list[dict], position: dict) -> bool:
    """Pending draws are distinct, in draw order, and drawn before the sampler's position."""
    keys = [(p["epoch"], p["offset"]) for p in pending] + [(position["epoch"], position["offset"])]
    return all(a < b for a, b in itertools.pairwise(keys))


def _count(value: Any) -> bool:
    """An int >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ---------------------------------------------------------------------------------------------
# Checkpoint directory bookkeeping
# ---------------------------------------------------------------------------------------------


def checkpoint_dirname(step: int) -> str:
    """Directory name of the checkpoint at ``step``, e.g. ``step_000040``."""
    return f"step_{step:06d}"


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Return ``(step, directory)`` of every complete checkpoint of a run, oldest first.

    Temporary ``.tmp_*`` entries are never listed: a ``step_*`` directory only exists once it
    has been written completely.
    """
    ckpt_root = Path(run_dir) / CHECKPOINTS_DIRNAME
    if not ckpt_root.is_dir():
        return []
    found = []
    for entry in ckpt_root.iterdir():
        match = _STEP_DIR_RE.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """Return the directory of the newest complete checkpoint of a run, or None if it has none.

    ``RUN/checkpoints/latest`` decides. If that pointer is absent (a crash between the first
    checkpoint's rename and the pointer's write), the highest-step ``step_*`` directory is used.

    Raises:
        UserError: ``latest`` names a directory that does not exist (edited by hand or copied
            partially).
    """
    ckpt_root = Path(run_dir) / CHECKPOINTS_DIRNAME
    pointer = ckpt_root / LATEST_FILENAME
    if pointer.is_file():
        name = pointer.read_text(encoding="utf-8").strip()
        target = ckpt_root / name
        if not name or not _STEP_DIR_RE.match(name) or not target.is_dir():
            raise UserError(
                f"{pointer} names checkpoint {name!r}, which does not exist in {ckpt_root}; "
                f"write the name of an existing step_* directory into it, or delete it to use "
                f"the newest one"
            )
        return target
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def _remove_leftovers(ckpt_root: Path) -> None:
    """Delete ``.tmp_*`` entries a crashed save left behind."""
    for entry in ckpt_root.iterdir():
        if entry.name.startswith(TMP_PREFIX):
            logger.info("removing leftover %s from an interrupted save", entry)
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def _point_latest_away_from(ckpt_root: Path, name: str) -> None:
    """Before ``name`` is swapped out, repoint ``latest`` to another checkpoint if it names it.

    Keeps the invariant that ``latest`` never names a missing directory, even for the instant
    between moving an old ``step_*`` directory aside and renaming its replacement into place.
    """
    pointer = ckpt_root / LATEST_FILENAME
    if not pointer.is_file() or pointer.read_text(encoding="utf-8").strip() != name:
        return
    others = [d for _s, d in list_checkpoints(ckpt_root.parent) if d.name != name]
    if others:
        write_text_atomic(pointer, others[-1].name + "\n")
    else:
        pointer.unlink()
        fsync_dir(ckpt_root)


def _prune(run_dir: Path, keep_last: int, keep: Path) -> None:
    """Delete all but the ``keep_last`` highest-step checkpoints; never delete ``keep``."""
    found = list_checkpoints(run_dir)
    survivors = {d for _s, d in found[-keep_last:]} | {keep}
    for _step, ckpt in found:
        if ckpt not in survivors:
            logger.info("deleting old checkpoint %s (keep_last=%d)", ckpt, keep_last)
            # Rename first so a crash mid-delete leaves a .tmp_* entry, not a broken step_* dir.
            doomed = ckpt.parent / f"{TMP_PREFIX}del_{ckpt.name}"
            os.replace(ckpt, doomed)
            shutil.rmtree(doomed)


# ---------------------------------------------------------------------------------------------
# Save and load
# ---------------------------------------------------------------------------------------------


def _write_parts(
    tmp_dir: Path,
    state: RunState,
    policy: Checkpointable,
    tokenizer: PretrainedSaver,
    critic: Checkpointable | None,
) -> None:
    """Write every file of a checkpoint into ``tmp_dir`` and fsync them all."""
    policy.save_pretrained(tmp_dir / MODEL_DIRNAME)  # transformers 5 always writes safetensors
    tokenizer.save_pretrained(tmp_dir / MODEL_DIRNAME)
    # Adam's two moments are each the size of the weights: check before writing them.
    require_free_space(tmp_dir, 2 * tree_bytes(tmp_dir / MODEL_DIRNAME))
    optimizer = policy.optimizer_state()
    trainer_state = {
        "optimizer": optimizer.optimizer,
        "scheduler": optimizer.scheduler,
        "rng": capture_rng_state(),
    }
    torch.save(trainer_state, tmp_dir / TRAINER_STATE_FILENAME)
    if critic is not None:
        critic.save_pretrained(tmp_dir / CRITIC_DIRNAME)
        critic_optimizer = critic.optimizer_state()
        critic_state = {
            "optimizer": critic_optimizer.optimizer,
            "scheduler": critic_optimizer.scheduler,
        }
        torch.save(critic_state, tmp_dir / CRITIC_STATE_FILENAME)
    text = json.dumps(state.to_json(), indent=2, sort_keys=True) + "\n"
    (tmp_dir / STATE_FILENAME).write_text(text, encoding="utf-8")
    fsync_tree(tmp_dir)
    write_manifest(tmp_dir)  # last: a checkpoint with a manifest was complete when saved


def _check_save_args(state: RunState, keep_last: int | None) -> None:
    """Raise TypeError / ValueError for a save that must write nothing."""
    if not isinstance(state, RunState):
        raise TypeError(f"state must be a RunState, got {type(state).__name__}")
    if state.step < 0:
        raise ValueError(f"step must be >= 0, got {state.step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")


def _install(tmp_dir: Path, final_dir: Path) -> None:
    """Rename the written ``tmp_dir`` to ``final_dir``, never leaving ``latest`` naming a
    missing directory meanwhile (the same step saved again replaces its directory)."""
    if final_dir.exists():
        _point_latest_away_from(final_dir.parent, final_dir.name)
    replace_dir(tmp_dir, final_dir)


def save_checkpoint(
    run_dir: str | os.PathLike[str],
    state: RunState,
    policy: Checkpointable,
    tokenizer: PretrainedSaver,
    keep_last: int | None = None,
    critic: Checkpointable | None = None,
) -> Path:
    """Write an atomic checkpoint of a run at ``state.step`` and point ``RUN/checkpoints/latest``
    at it.

    Args:
        run_dir: the run directory ``RUN``.
        state: the run state, written to ``state.json``; ``state.step`` names the directory.
        policy: the policy's trainer: its weights go to ``model/`` (safetensors), its optimizer
            and schedule to ``trainer_state.pt`` with the RNG states.
        tokenizer: saved under ``model/`` so ``from_pretrained`` finds both.
        keep_last: keep only this many highest-step checkpoints, deleting older ones after the
            new one is in place; None keeps all.
        critic: a PPO critic's trainer, saved as ``critic/`` and ``critic_state.pt`` in the same
            atomic directory.

    Returns:
        The checkpoint directory ``RUN/checkpoints/step_{step:06d}``.

    Raises:
        TypeError: ``state`` is not a :class:`RunState` (nothing is written).
        ValueError: ``state.step`` is negative or ``keep_last`` below 1 (nothing is written).
        DiskFullError: less free space than the last checkpoint's size (checked before
            writing) or than the optimizer state needs, or a write failed with ENOSPC; the
            temporary directory is removed, the previous checkpoints and ``latest`` untouched.
        OSError: the disk is not writable; the previous checkpoints and ``latest`` are
            left untouched.
    """
    _check_save_args(state, keep_last)
    run_dir = Path(run_dir)
    ckpt_root = run_dir / CHECKPOINTS_DIRNAME
    ckpt_root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(ckpt_root)

    previous = list_checkpoints(run_dir)
    needed = tree_bytes(previous[-1][1]) if previous else 0  # the last one's size, if any
    require_free_space(ckpt_root, needed)
    name = checkpoint_dirname(state.step)
    tmp_dir = ckpt_root / f"{TMP_PREFIX}{name}.{os.getpid()}"  # mkdir, not mkdtemp: not 0700
    tmp_dir.mkdir()
    final_dir = ckpt_root / name
    try:
        _write_parts(tmp_dir, state, policy, tokenizer, critic)
        _install(tmp_dir, final_dir)
    except BaseException as e:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if is_disk_full(e):
            raise disk_full_error(ckpt_root, needed, e) from e
        raise
    write_text_atomic(ckpt_root / LATEST_FILENAME, name + "\n")
    if keep_last is not None:
        _prune(run_dir, keep_last, keep=final_dir)
    logger.info("saved checkpoint %s", final_dir)
    return final_dir


def resume_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The checkpoint a resumed run starts from: the one ``latest`` names if it verifies, else
    the newest older one that does (each fallback is logged with the reason); None if the run
    has no checkpoint.

    A checkpoint verifies when it holds every part and every file its manifest lists has its
    saved size and SHA-256 (:func:`~treadle.store.manifest.verify_manifest`); one saved before
    manifests existed is used unverified, with a warning.

    Raises:
        UserError: ``latest`` names a missing directory, or no checkpoint verifies (every
            checkpoint is named with its reason).
    """
    newest = latest_checkpoint(run_dir)
    if newest is None:
        return None
    candidates = [d for _s, d in reversed(list_checkpoints(run_dir)) if d.name <= newest.name]
    problems = []
    for ckpt in candidates:
        try:
            _check_complete(ckpt)
            verified = verify_manifest(ckpt)
            if read_checkpoint_state(ckpt).schema_version >= MANIFEST_SINCE and not verified:
                raise CorruptCheckpointError(f"{ckpt}: manifest.json is missing")
        except UserError as e:
            problems.append(f"{ckpt.name}: {e}")
            logger.warning("checkpoint %s is not valid (%s); trying the previous one", ckpt, e)
            continue
        if not verified:
            logger.warning(
                "checkpoint %s has no manifest (saved by an older treadle): loading it unverified",
                ckpt,
            )
        if ckpt != newest:
            logger.warning(
                "resuming from %s instead of %s, which is not valid", ckpt.name, newest.name
            )
        return ckpt
    raise CorruptCheckpointError(
        f"no valid checkpoint in {Path(run_dir) / CHECKPOINTS_DIRNAME} ({'; '.join(problems)}); "
        "restore one from a copy, or start the run again under a new run.name"
    )


def _check_complete(ckpt_dir: Path) -> None:
    """Raise :class:`UserError` unless ``ckpt_dir`` holds every part of a checkpoint."""
    if not ckpt_dir.is_dir():
        raise UserError(
            f"checkpoint directory {ckpt_dir} does not exist; pass an existing "
            f"RUN/{CHECKPOINTS_DIRNAME}/step_* directory, or start without --resume"
        )
    for part in (MODEL_DIRNAME, TRAINER_STATE_FILENAME, STATE_FILENAME):
        if not (ckpt_dir / part).exists():
            raise UserError(
                f"checkpoint {ckpt_dir} is incomplete (no {part}); resume from an earlier "
                f"checkpoint by writing its name into {ckpt_dir.parent / LATEST_FILENAME}, or "
                f"start without --resume"
            )


def read_checkpoint_state(ckpt_dir: str | os.PathLike[str]) -> RunState:
    """The run state of a checkpoint (``state.json``, of any schema version this code reads).

    Raises:
        UserError: the checkpoint is missing or incomplete, ``state.json`` is corrupt or not a
            run state, or it has a newer schema version (see :meth:`RunState.from_json`).
    """
    ckpt_dir = Path(ckpt_dir)
    _check_complete(ckpt_dir)
    path = ckpt_dir / STATE_FILENAME
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(
            f"{path} is corrupt ({e}); resume from an earlier checkpoint or start without --resume"
        ) from e
    return RunState.from_json(raw, path)


def _load_torch(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, ... here
        raise UserError(
            f"{path} is corrupt ({type(e).__name__}: {e}); resume from an earlier checkpoint "
            f"or start without --resume"
        ) from e


def load_trainer_state(ckpt_dir: str | os.PathLike[str], policy: Checkpointable) -> RunState:
    """Restore the policy trainer's optimizer and lr-scheduler state and the RNG states from a
    checkpoint; return its run state.

    The trainer must hold the model loaded from ``ckpt_dir / "model"``; its optimizer's state
    tensors move to the parameters' devices.

    Raises:
        UserError: the checkpoint is missing, incomplete or corrupt, or its optimizer/scheduler
            state does not fit the trainer (a different model or config).
    """
    ckpt_dir = Path(ckpt_dir)
    state = read_checkpoint_state(ckpt_dir)
    path = ckpt_dir / TRAINER_STATE_FILENAME
    trainer_state = _load_torch(path)
    try:
        policy.load_optimizer_state(
            OptimizerState(trainer_state["optimizer"], trainer_state["scheduler"])
        )
    except (KeyError, ValueError) as e:
        raise UserError(
            f"optimizer/scheduler state in {path} does not fit this run ({e}); resume with "
            f"the model and optimizer config the checkpoint was saved with"
        ) from e
    restore_rng_state(trainer_state["rng"])
    return state


def load_critic_state(ckpt_dir: str | os.PathLike[str], critic: Checkpointable) -> None:
    """Restore a critic's optimizer and scheduler state saved by :func:`save_checkpoint`
    (the critic's weights load from ``ckpt_dir / "critic"``).

    Raises:
        UserError: the checkpoint holds no critic or its state does not fit.
    """
    path = Path(ckpt_dir) / CRITIC_STATE_FILENAME
    if not path.is_file():
        raise UserError(
            f"checkpoint {ckpt_dir} holds no critic ({path.name} is missing): it was saved by a "
            "run without algorithm.advantage=gae; resume with that run's config"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        critic.load_optimizer_state(OptimizerState(state["optimizer"], state["scheduler"]))
    except Exception as e:  # corrupt file or a state of another shape
        raise UserError(f"critic state {path} cannot be restored ({type(e).__name__}: {e})") from e
