"""Atomic checkpoints of a run, and atomic small-file writes.

Layout under a run directory ``RUN``::

    RUN/checkpoints/
        latest                   text file: name of the newest complete checkpoint, e.g. step_000040
        step_000040/
            model/               Hugging Face format (safetensors, config, tokenizer files)
            trainer_state.pt     optimizer and lr-scheduler state dicts, RNG states
            state.json           {"step": 40, "data_position": {...}, "policy_version": 40, ...}

A checkpoint is written into a hidden sibling ``.tmp_step_*`` directory, every file is fsynced,
and the directory is renamed into place with :func:`os.replace` (atomic on one filesystem).
``latest`` is rewritten the same way, only after the new directory is in place. So a crash at any
moment leaves either the old state or the new one: never a half-written ``step_*`` directory, and
never a ``latest`` that names a missing directory. Leftover ``.tmp_*`` entries from a crash are
removed by the next save.

Model weights are loaded by the caller: ``AutoModelForCausalLM.from_pretrained(ckpt / "model")``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from treadle.core.errors import UserError

logger = logging.getLogger(__name__)

CHECKPOINTS_DIRNAME = "checkpoints"
LATEST_FILENAME = "latest"
MODEL_DIRNAME = "model"
TRAINER_STATE_FILENAME = "trainer_state.pt"
STATE_FILENAME = "state.json"
CRITIC_DIRNAME = "critic"
CRITIC_STATE_FILENAME = "critic_state.pt"
_TMP_PREFIX = ".tmp_"
_STEP_DIR_RE = re.compile(r"^step_(\d{6,})$")

JsonState = dict[str, int | float | str | dict]
"""Plain JSON-able run state the caller stores with a checkpoint (``state.json``)."""


class PretrainedSaver(Protocol):
    """What a Hugging Face model or tokenizer offers for saving (``save_pretrained``)."""

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> Any: ...


@dataclass(frozen=True)
class CriticParts:
    """A critic's model and optimizer state, checkpointed beside the policy."""

    model: PretrainedSaver
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None


# ---------------------------------------------------------------------------------------------
# Atomic small-file writes
# ---------------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    """Fsync a directory so a rename or a new entry in it survives a power loss (POSIX only)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically: :func:`write_bytes_atomic`."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` so readers see the old file or the new one, never half.

    The bytes go to a temporary file in the same directory, is fsynced, and replaces ``path``
    with :func:`os.replace`; the directory is fsynced afterwards. Parent directories are created.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: the directory is not writable or the disk is full (the temporary file is
            removed and ``path`` is left as it was).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{path.name}.", dir=path.parent)
    try:
        # mkstemp creates the file 0600; keep the replaced file's mode, else the usual 0644.
        os.chmod(tmp_name, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _nulls_for_non_finite(obj: Any) -> Any:
    """Copy of ``obj`` with every NaN/infinite float inside dicts, lists and tuples set to None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: _nulls_for_non_finite(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [_nulls_for_non_finite(value) for value in obj]
    return obj


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write ``obj`` as indented JSON (keys in dict order) to ``path`` atomically.

    NaN and infinite floats are written as ``null`` (strict JSON has no word for them), so a
    diverged metric in a summary never fails the write. See :func:`write_text_atomic` for how
    the write is made atomic.

    Raises:
        TypeError: ``obj`` holds something JSON cannot encode (nothing is written).
        OSError: as :func:`write_text_atomic`.
    """
    text = json.dumps(_nulls_for_non_finite(obj), indent=2, allow_nan=False) + "\n"
    return write_text_atomic(path, text)


def _fsync_tree(root: Path) -> None:
    """Fsync every file and directory under ``root`` (``root`` included)."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


# ---------------------------------------------------------------------------------------------
# RNG state
# ---------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """Return the RNG states of python ``random``, numpy's global RNG, torch CPU and CUDA.

    The result holds only tensors, ints, floats, strings, tuples and dicts, so it loads with
    ``torch.load(weights_only=True)``. The CUDA entry is an empty list without CUDA.
    """
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(rng: dict[str, Any]) -> None:
    """Restore RNG states captured by :func:`capture_rng_state`.

    CUDA states are restored only when the number of visible devices matches the saved one;
    otherwise a warning is logged and the CUDA generators keep their current state.
    """
    random.setstate(rng["python"])
    np_rng = rng["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_rng["bit_generator"],
            "state": {"key": np_rng["key"].numpy().astype(np.uint32), "pos": np_rng["pos"]},
            "has_gauss": np_rng["has_gauss"],
            "gauss": np_rng["gauss"],
        }
    )
    torch.set_rng_state(rng["torch_cpu"])
    cuda_states = rng["torch_cuda"]
    if not cuda_states:
        return
    if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
        torch.cuda.set_rng_state_all(cuda_states)
    else:
        logger.warning(
            "checkpoint holds RNG states for %d CUDA devices but %d are visible; "
            "CUDA sampling will not continue identically",
            len(cuda_states),
            torch.cuda.device_count() if torch.cuda.is_available() else 0,
        )


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
        if entry.name.startswith(_TMP_PREFIX):
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
        _fsync_dir(ckpt_root)


def _install(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a fully written ``tmp_dir`` to ``final_dir``, replacing an existing one."""
    ckpt_root = final_dir.parent
    old_aside: Path | None = None
    if final_dir.exists():
        # os.replace cannot overwrite a non-empty directory: move the old one aside first.
        if (ckpt_root / LATEST_FILENAME).is_file():
            _point_latest_away_from(ckpt_root, final_dir.name)
        old_aside = ckpt_root / f"{_TMP_PREFIX}old_{final_dir.name}"
        if old_aside.exists():
            shutil.rmtree(old_aside)
        os.replace(final_dir, old_aside)
    try:
        os.replace(tmp_dir, final_dir)
    except BaseException:
        if old_aside is not None:
            os.replace(old_aside, final_dir)
        raise
    _fsync_dir(ckpt_root)
    if old_aside is not None:
        shutil.rmtree(old_aside)


def _prune(run_dir: Path, keep_last: int, keep: Path) -> None:
    """Delete all but the ``keep_last`` highest-step checkpoints; never delete ``keep``."""
    found = list_checkpoints(run_dir)
    survivors = {d for _s, d in found[-keep_last:]} | {keep}
    for _step, ckpt in found:
        if ckpt not in survivors:
            logger.info("deleting old checkpoint %s (keep_last=%d)", ckpt, keep_last)
            # Rename first so a crash mid-delete leaves a .tmp_* entry, not a broken step_* dir.
            doomed = ckpt.parent / f"{_TMP_PREFIX}del_{ckpt.name}"
            os.replace(ckpt, doomed)
            shutil.rmtree(doomed)


# ---------------------------------------------------------------------------------------------
# Save and load
# ---------------------------------------------------------------------------------------------


def _write_parts(
    tmp_dir: Path,
    model: PretrainedSaver,
    tokenizer: PretrainedSaver,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    state_text: str,
    critic: CriticParts | None = None,
) -> None:
    """Write every file of a checkpoint into ``tmp_dir`` and fsync them all."""
    model.save_pretrained(tmp_dir / MODEL_DIRNAME)  # transformers 5 always writes safetensors
    tokenizer.save_pretrained(tmp_dir / MODEL_DIRNAME)
    trainer_state = {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": capture_rng_state(),
    }
    torch.save(trainer_state, tmp_dir / TRAINER_STATE_FILENAME)
    if critic is not None:
        critic.model.save_pretrained(tmp_dir / CRITIC_DIRNAME)
        critic_state = {
            "optimizer": critic.optimizer.state_dict(),
            "scheduler": critic.scheduler.state_dict() if critic.scheduler is not None else None,
        }
        torch.save(critic_state, tmp_dir / CRITIC_STATE_FILENAME)
    (tmp_dir / STATE_FILENAME).write_text(state_text, encoding="utf-8")
    _fsync_tree(tmp_dir)


def save_model_atomic(model: PretrainedSaver, tokenizer: PretrainedSaver, folder: Path) -> Path:
    """Write a Hugging Face model folder (weights + tokenizer) so it is never half-written.

    Everything goes into a temporary sibling, is fsynced, and then replaces ``folder`` the way
    a checkpoint directory is installed (an existing folder is swapped out, not deleted first).
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = folder.with_name(f"{_TMP_PREFIX}{folder.name}.{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    try:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        _fsync_tree(tmp_dir)
        _install(tmp_dir, folder)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return folder


def save_checkpoint(
    run_dir: str | os.PathLike[str],
    step: int,
    model: PretrainedSaver,
    tokenizer: PretrainedSaver,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    state: JsonState,
    keep_last: int | None = None,
    critic: CriticParts | None = None,
) -> Path:
    """Write an atomic checkpoint of a run at ``step`` and point ``RUN/checkpoints/latest`` at it.

    Args:
        run_dir: the run directory ``RUN``.
        step: optimizer steps taken so far (names the directory ``step_{step:06d}``).
        model: Hugging Face model; saved as safetensors under ``model/``.
        tokenizer: its tokenizer; saved under ``model/`` so ``from_pretrained`` finds both.
        optimizer: saved with its ``state_dict()`` into ``trainer_state.pt``.
        scheduler: lr scheduler saved likewise, or None when the run has none.
        state: JSON-able run state (data position, policy version, ...) written to
            ``state.json`` together with ``"step": step``.
        keep_last: keep only this many highest-step checkpoints, deleting older ones after the
            new one is in place; None keeps all.
        critic: a PPO critic, saved as ``critic/`` (Hugging Face format) and
            ``critic_state.pt`` (its optimizer and scheduler) in the same atomic directory.

    Returns:
        The checkpoint directory ``RUN/checkpoints/step_{step:06d}``.

    Raises:
        ValueError: ``step`` is negative, ``keep_last`` is below 1, ``state`` holds a
            ``"step"`` that differs from ``step``, or a NaN/infinite float (nothing is written).
        TypeError: ``state`` is not JSON-able (raised before anything is written).
        OSError: the disk is full or not writable; the previous checkpoints and ``latest`` are
            left untouched.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if "step" in state and state["step"] != step:
        raise ValueError(f"state['step']={state['step']!r} differs from step={step}")
    state_text = json.dumps({**state, "step": step}, indent=2, sort_keys=True, allow_nan=False)
    state_text += "\n"

    run_dir = Path(run_dir)
    ckpt_root = run_dir / CHECKPOINTS_DIRNAME
    ckpt_root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(ckpt_root)

    name = checkpoint_dirname(step)
    tmp_dir = ckpt_root / f"{_TMP_PREFIX}{name}.{os.getpid()}"  # mkdir, not mkdtemp: not 0700
    tmp_dir.mkdir()
    try:
        _write_parts(tmp_dir, model, tokenizer, optimizer, scheduler, state_text, critic)
        final_dir = ckpt_root / name
        _install(tmp_dir, final_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise

    write_text_atomic(ckpt_root / LATEST_FILENAME, name + "\n")
    if keep_last is not None:
        _prune(run_dir, keep_last, keep=final_dir)
    logger.info("saved checkpoint %s", final_dir)
    return final_dir


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


def read_checkpoint_state(ckpt_dir: str | os.PathLike[str]) -> JsonState:
    """Return the ``state.json`` dict of a checkpoint (it always holds ``"step"``).

    Raises:
        UserError: the checkpoint is missing, incomplete, or ``state.json`` is not a JSON
            object with an integer ``"step"``.
    """
    ckpt_dir = Path(ckpt_dir)
    _check_complete(ckpt_dir)
    path = ckpt_dir / STATE_FILENAME
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(
            f"{path} is corrupt ({e}); resume from an earlier checkpoint or start without --resume"
        ) from e
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise UserError(
            f"{path} is not a checkpoint state (a JSON object with an integer 'step'); resume "
            f"from an earlier checkpoint or start without --resume"
        )
    return state


def load_trainer_state(
    ckpt_dir: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
) -> JsonState:
    """Restore optimizer, lr-scheduler and RNG states from a checkpoint; return its state.json.

    The optimizer must be built over the parameters of the model loaded from
    ``ckpt_dir / "model"`` (same order); its state tensors are moved to those parameters'
    devices by :meth:`torch.optim.Optimizer.load_state_dict`.

    Raises:
        UserError: the checkpoint is missing, incomplete or corrupt, or its optimizer/scheduler
            state does not fit the given optimizer/scheduler (a different model or config).
    """
    ckpt_dir = Path(ckpt_dir)
    state = read_checkpoint_state(ckpt_dir)
    path = ckpt_dir / TRAINER_STATE_FILENAME
    try:
        trainer_state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, ... here
        raise UserError(
            f"{path} is corrupt ({type(e).__name__}: {e}); resume from an earlier checkpoint "
            f"or start without --resume"
        ) from e
    try:
        optimizer.load_state_dict(trainer_state["optimizer"])
        if scheduler is not None:
            if trainer_state["scheduler"] is None:
                raise ValueError("the checkpoint was saved without an lr scheduler")
            scheduler.load_state_dict(trainer_state["scheduler"])
    except (KeyError, ValueError) as e:
        raise UserError(
            f"optimizer/scheduler state in {path} does not fit this run ({e}); resume with "
            f"the model and optimizer config the checkpoint was saved with"
        ) from e
    restore_rng_state(trainer_state["rng"])
    return state


def load_critic_state(
    ckpt_dir: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
) -> None:
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
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
    except Exception as e:  # corrupt file or a state of another shape
        raise UserError(f"critic state {path} cannot be restored ({type(e).__name__}: {e})") from e
