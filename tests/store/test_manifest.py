"""Checkpoints that verify themselves: the manifest, the fallback to the newest valid checkpoint
on resume, and the disk-full checks before and during a save."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from tests.store.test_checkpoint import save
from treadle.store import checkpoint, manifest
from treadle.store.checkpoint import list_checkpoints, resume_checkpoint
from treadle.store.manifest import (
    CorruptCheckpointError,
    DiskFullError,
    verify_manifest,
    write_manifest,
)


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"abc")
    (tmp_path / "sub" / "b.txt").write_bytes(b"")
    write_manifest(tmp_path)
    files = json.loads((tmp_path / "manifest.json").read_text())["files"]
    # sha256("abc") is the FIPS 180-2 test vector ba7816bf...; sha256("") is e3b0c442...
    assert files == {
        "a.bin": {"size": 3, "sha256": hashlib.sha256(b"abc").hexdigest()},
        "sub/b.txt": {"size": 0, "sha256": hashlib.sha256(b"").hexdigest()},
    }
    assert files["a.bin"]["sha256"].startswith("ba7816bf")
    assert verify_manifest(tmp_path) is True


def test_a_folder_without_a_manifest_is_unverified_not_corrupt(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"abc")
    assert verify_manifest(tmp_path) is False


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "bytes, saved as"),
        (lambda p: p.unlink(), "is missing"),
        (lambda p: _flip(p, offset=len(p.read_bytes()) // 2, count=64), "SHA-256"),
        (lambda p: _flip(p, offset=0, count=1), "SHA-256"),
    ],
    ids=["truncated-to-half", "deleted", "64-bytes-flipped", "one-bit-flipped"],
)
def test_damaged_weights_are_found_and_named(tmp_path: Path, trained, damage, message) -> None:
    ckpt = save(tmp_path, 1, *trained)
    weights = ckpt / "model" / "model.safetensors"
    damage(weights)
    with pytest.raises(CorruptCheckpointError, match=message) as caught:
        verify_manifest(ckpt)
    assert "model/model.safetensors" in str(caught.value)


def _flip(path: Path, offset: int, count: int) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0x01 if count == 1 else 0xFF
    path.write_bytes(bytes(data))


def test_resume_falls_back_to_the_previous_valid_checkpoint(tmp_path, trained, caplog) -> None:
    for step in (2, 4):
        save(tmp_path, step, *trained)
    assert resume_checkpoint(tmp_path).name == "step_000004"
    _flip(tmp_path / "checkpoints" / "step_000004" / "model" / "model.safetensors", 100, 64)
    with caplog.at_level(logging.WARNING, logger="treadle.store.checkpoint"):
        assert resume_checkpoint(tmp_path).name == "step_000002"
    logged = caplog.text
    assert "step_000004" in logged and "SHA-256" in logged
    assert "resuming from step_000002 instead of step_000004" in logged
    # Nothing is deleted: the damaged checkpoint stays for a person to look at.
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4]


def test_no_valid_checkpoint_is_one_error_naming_each(tmp_path, trained) -> None:
    for step in (2, 4):
        save(tmp_path, step, *trained)
    (tmp_path / "checkpoints" / "step_000002" / "trainer_state.pt").unlink()
    (tmp_path / "checkpoints" / "step_000004" / "state.json").write_text("{}")
    with pytest.raises(CorruptCheckpointError) as caught:
        resume_checkpoint(tmp_path)
    text = str(caught.value)
    assert "no valid checkpoint" in text
    assert "step_000004" in text and "state.json" in text
    assert "step_000002" in text and "trainer_state.pt" in text


def test_a_checkpoint_saved_before_manifests_loads_unverified(tmp_path, trained, caplog) -> None:
    ckpt = save(tmp_path, 2, *trained)
    (ckpt / "manifest.json").unlink()
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "schema_version": 2}))
    with caplog.at_level(logging.WARNING, logger="treadle.store.checkpoint"):
        assert resume_checkpoint(tmp_path) == ckpt
    assert "no manifest" in caplog.text


def test_a_deleted_manifest_is_damage_not_an_old_checkpoint(tmp_path, trained) -> None:
    for step in (2, 4):
        save(tmp_path, step, *trained)
    # state.json's schema version 3 promises a manifest: without it step 4 is not trusted.
    (tmp_path / "checkpoints" / "step_000004" / "manifest.json").unlink()
    assert resume_checkpoint(tmp_path).name == "step_000002"


Usage = namedtuple("Usage", "total used free")


def test_too_little_free_space_is_refused_before_writing(tmp_path, trained, monkeypatch) -> None:
    first = save(tmp_path, 2, *trained)
    size = manifest.tree_bytes(first)
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: Usage(10 * size, 9 * size, size - 1))
    with pytest.raises(DiskFullError, match=r"disk full: need \d+\.\d MiB at .*checkpoints"):
        save(tmp_path, 4, *trained)
    # Nothing half-written: no new directory, no temporary one, latest unchanged.
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_000002"]


def test_a_write_that_runs_out_of_space_is_named_and_leaves_the_last_checkpoint(
    tmp_path, trained, monkeypatch
) -> None:
    save(tmp_path, 2, *trained)

    def full(*_args, **_kwargs):  # torch.save on a full disk: a short write
        raise RuntimeError("[enforce fail at inline_container.cc:778] . unexpected pos 64 vs 0")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(DiskFullError, match=r"disk full: a checkpoint write at .* failed"):
        save(tmp_path, 4, *trained)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_000002"]
    assert resume_checkpoint(tmp_path).name == "step_000002"


def test_enospc_is_disk_full_and_other_errors_are_not() -> None:
    assert manifest.is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not manifest.is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not manifest.is_disk_full(RuntimeError("CUDA out of memory"))
