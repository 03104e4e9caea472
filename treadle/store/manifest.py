"""Checkpoints that verify themselves: a manifest of every file's size and SHA-256, written last,
and the free-space check made before a checkpoint is written.

``manifest.json`` inside a checkpoint directory::

    {"schema_version": 1, "files": {"model/model.safetensors": {"size": 123, "sha256": "..."},
                                    "trainer_state.pt": {...}, "state.json": {...}, ...}}

It is written after every other file is written and fsynced, so a checkpoint whose manifest
is present was complete when it was saved; :func:`verify_manifest` then finds any file that has
since been truncated, deleted or changed (one flipped bit changes the SHA-256).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from treadle.core.errors import UserError
from treadle.store.atomic import write_text_atomic

logger = logging.getLogger(__name__)

MANIFEST_FILENAME = "manifest.json"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20  # bytes read per hash update


class CorruptCheckpointError(UserError):
    """A checkpoint file is missing, truncated or altered since it was saved; the message names
    the checkpoint, the file and what differs."""


class DiskFullError(UserError):
    """Not enough free space to write a checkpoint (or a write failed with ENOSPC); the message
    names the bytes needed, the bytes free and the path."""


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(root: Path) -> list[Path]:
    """Every regular file under ``root`` except the manifest, sorted by relative path."""
    found = [p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILENAME]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def write_manifest(root: Path) -> Path:
    """Write ``root/manifest.json`` listing every file under ``root`` with its size (bytes) and
    SHA-256. Call it last, after every file is written and fsynced.

    Raises:
        OSError: as :func:`~treadle.store.atomic.write_text_atomic`.
    """
    files = {
        p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in _files(root)
    }
    text = json.dumps({"schema_version": MANIFEST_VERSION, "files": files}, indent=1) + "\n"
    return write_text_atomic(root / MANIFEST_FILENAME, text)


def verify_manifest(root: Path) -> bool:
    """Check every file ``root/manifest.json`` lists: present, of its size, of its SHA-256.

    Returns:
        True when verified; False when ``root`` has no manifest (a checkpoint saved before
        manifests existed: it can be loaded, not verified).

    Raises:
        CorruptCheckpointError: the manifest is unreadable, or a listed file is missing, of
            another size or of another SHA-256 (the first such file is named).
    """
    path = root / MANIFEST_FILENAME
    if not path.exists():
        return False
    try:
        listed = json.loads(path.read_text(encoding="utf-8"))["files"]
        entries = [(name, int(e["size"]), str(e["sha256"])) for name, e in listed.items()]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"{path} is unreadable ({type(e).__name__}: {e})") from e
    for name, size, sha in entries:
        file = root / name
        if not file.is_file():
            raise CorruptCheckpointError(f"{root}: {name} is missing")
        actual = file.stat().st_size
        if actual != size:
            raise CorruptCheckpointError(f"{root}: {name} is {actual} bytes, saved as {size}")
        if sha256_file(file) != sha:
            raise CorruptCheckpointError(f"{root}: {name} does not match its SHA-256 (altered)")
    return True


def tree_bytes(root: Path) -> int:
    """Total size (bytes) of the regular files under ``root``."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _gib(n: int) -> str:
    """A size for a person: MiB below a GiB (a tiny model's checkpoint), else GiB."""
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def require_writable(folder: Path) -> None:
    """Create and delete a file in ``folder``: a read-only mount or a folder without write
    permission is found before work that would be lost when the first write fails.

    Raises:
        UserError: naming the folder and the reason.
    """
    try:
        fd, name = tempfile.mkstemp(prefix=".tmp_probe.", dir=folder)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise UserError(
            f"cannot write in {folder} ({e.strerror}); make it writable (or move the run "
            "directory to a writable disk) and run the command again"
        ) from None


def require_free_space(path: Path, needed: int) -> None:
    """Refuse to start a write of ``needed`` bytes under ``path`` without room for it.

    Raises:
        DiskFullError: ``shutil.disk_usage(path).free`` is below ``needed`` (bytes).
    """
    free = shutil.disk_usage(path).free
    if free < needed:
        raise DiskFullError(
            f"disk full: need {_gib(needed)} at {path} for a checkpoint, {_gib(free)} free; "
            "free space (or set run.output_dir on a larger disk) and resume with --resume: "
            "no checkpoint was changed"
        )


def is_disk_full(error: BaseException) -> bool:
    """Whether a failed write ran out of space: ENOSPC/EDQUOT, or torch's ``RuntimeError`` from
    a short write (its message never says why; the free space then decides)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(error, RuntimeError) and "unexpected pos" in str(error)


def disk_full_error(path: Path, needed: int, error: BaseException) -> DiskFullError:
    """The :class:`DiskFullError` for a write under ``path`` that failed with ``error``."""
    free = shutil.disk_usage(path).free if path.exists() else 0
    logger.debug("write under %s failed: %r", path, error)
    return DiskFullError(
        f"disk full: a checkpoint write at {path} failed ({type(error).__name__}), "
        f"{_gib(free)} free; free space (or set run.output_dir on a larger disk) and resume "
        "with --resume: no checkpoint was changed"
    )
