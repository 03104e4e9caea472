"""Writes that a crash cannot leave half done: small files and whole model folders.

A file is written to a temporary sibling, fsynced, and renamed over the target with
:func:`os.replace` (atomic on one filesystem); a folder is written whole into a hidden sibling,
fsynced, and swapped in. Readers see the old version or the new one, never a mix.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

TMP_PREFIX = ".tmp_"
"""Prefix of the temporary siblings (a crash may leave them; they are never read)."""


class PretrainedSaver(Protocol):
    """What a Hugging Face model or tokenizer (or a training backend) offers for saving."""

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> Any:
        """Write it to ``save_directory`` in Hugging Face format."""
        ...


def fsync_dir(path: Path) -> None:
    """Fsync a directory so a rename or a new entry in it survives a power loss (POSIX only)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Fsync every file and directory under ``root`` (``root`` included)."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


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
    fd, tmp_name = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}.", dir=path.parent)
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
    fsync_dir(path.parent)
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


def replace_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a fully written ``tmp_dir`` to ``final_dir``, replacing an existing one (moved
    aside first, since :func:`os.replace` cannot overwrite a non-empty directory, and removed
    once the new one is in place)."""
    parent = final_dir.parent
    old_aside: Path | None = None
    if final_dir.exists():
        old_aside = parent / f"{TMP_PREFIX}old_{final_dir.name}"
        if old_aside.exists():
            shutil.rmtree(old_aside)
        os.replace(final_dir, old_aside)
    try:
        os.replace(tmp_dir, final_dir)
    except BaseException:
        if old_aside is not None:
            os.replace(old_aside, final_dir)
        raise
    fsync_dir(parent)
    if old_aside is not None:
        shutil.rmtree(old_aside)


def save_model_atomic(model: PretrainedSaver, tokenizer: PretrainedSaver, folder: Path) -> Path:
    """Write a Hugging Face model folder (weights + tokenizer) so it is never half-written.

    Everything goes into a temporary sibling, is fsynced, and then replaces ``folder`` the way
    a checkpoint directory is installed (an existing folder is swapped out, not deleted first).
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = folder.with_name(f"{TMP_PREFIX}{folder.name}.{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    try:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        fsync_tree(tmp_dir)
        replace_dir(tmp_dir, folder)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return folder
