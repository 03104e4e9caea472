"""Tests for treadle.store.checkpoint: round trip of a tiny Qwen2 run, atomicity under crashes."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2ForCausalLM,
)

from treadle.core.errors import UserError
from treadle.core.protocols import OptimizerState
from treadle.core.types import DataPosition
from treadle.store import checkpoint
from treadle.store.atomic import save_model_atomic, write_json_atomic
from treadle.store.checkpoint import (
    RunState,
    latest_checkpoint,
    list_checkpoints,
    load_trainer_state,
    read_checkpoint_state,
    save_checkpoint,
)

WORDS = ["<unk>", "<pad>", "<eos>", "one", "two", "three", "plus", "is"]


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {word: i for i, word in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )


def _optimizer_and_scheduler(
    model: torch.nn.Module,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return optimizer, scheduler


BATCH = torch.tensor([[3, 6, 4, 7, 5, 2], [4, 6, 3, 7, 5, 2]])


def _train_step(model, optimizer, scheduler) -> None:
    loss = model(input_ids=BATCH, labels=BATCH).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def _draw() -> tuple[list[float], float, list[float]]:
    return torch.rand(4).tolist(), random.random(), np.random.rand(3).tolist()


STATE = RunState(step=1, policy_version=1, data_position=DataPosition(epoch=0, offset=16))


@dataclasses.dataclass
class Trainer:
    """The checkpoint's view of a trainer (``Checkpointable``) over a bare model, optimizer and
    schedule: what a training backend hands a checkpoint."""

    model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def save_pretrained(self, folder: Path) -> None:
        self.model.save_pretrained(folder)

    def optimizer_state(self) -> OptimizerState:
        return OptimizerState(self.optimizer.state_dict(), self.scheduler.state_dict())

    def load_optimizer_state(self, state: OptimizerState) -> None:
        self.optimizer.load_state_dict(state.optimizer)
        self.scheduler.load_state_dict(state.scheduler)


def save(run_dir, step, model, tokenizer, optimizer, scheduler, state=STATE, **kwargs):
    """save_checkpoint of a bare model/optimizer/schedule at ``step``."""
    trainer = Trainer(model, optimizer, scheduler)
    return save_checkpoint(
        run_dir, dataclasses.replace(state, step=step), trainer, tokenizer, **kwargs
    )


def load(ckpt, optimizer, scheduler) -> RunState:
    """load_trainer_state into a bare optimizer/schedule."""
    return load_trainer_state(ckpt, Trainer(None, optimizer, scheduler))


def test_round_trip_restores_model_optimizer_scheduler_and_rng(tmp_path: Path, trained) -> None:
    model, tokenizer, optimizer, scheduler = trained
    ckpt = save(tmp_path, 1, model, tokenizer, optimizer, scheduler)
    expected_draws = _draw()  # what the run would have sampled next
    assert ckpt == tmp_path / "checkpoints" / "step_000001"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000001\n"
    assert latest_checkpoint(tmp_path) == ckpt
    assert (ckpt / "model" / "model.safetensors").is_file()

    # A new process: the caller loads weights, builds a fresh optimizer, restores the rest.
    _draw()  # advance the RNGs past the checkpoint so a restore has something to undo
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    for (name, p), (name2, q) in zip(
        model.named_parameters(), reloaded.named_parameters(), strict=True
    ):
        assert name == name2
        assert torch.equal(p, q), name
    optimizer2, scheduler2 = _optimizer_and_scheduler(reloaded)
    state = load(ckpt, optimizer2, scheduler2)

    assert state == dataclasses.replace(STATE, step=1)
    assert _draw() == expected_draws
    assert scheduler2.last_epoch == scheduler.last_epoch == 1
    assert scheduler2.get_last_lr() == scheduler.get_last_lr() == [5e-4]  # 1e-3 / (1 + 1)
    before, after = optimizer.state_dict(), optimizer2.state_dict()
    assert before["param_groups"] == after["param_groups"]
    assert before["state"].keys() == after["state"].keys()
    for index, moments in before["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[key], after["state"][index][key]), (index, key)
    # transformers 5's AutoTokenizer would pick Qwen2Tokenizer from config.json's model_type and
    # rebuild a BPE around this WordLevel vocab, so the test tokenizer is reloaded by its class.
    reloaded_tokenizer = PreTrainedTokenizerFast.from_pretrained(ckpt / "model")
    assert reloaded_tokenizer("one plus two").input_ids == [3, 6, 4]
    assert reloaded_tokenizer.eos_token == "<eos>"

    # Both runs take the same next step and stay identical.
    _train_step(model, optimizer, scheduler)
    _train_step(reloaded, optimizer2, scheduler2)
    for p, q in zip(model.parameters(), reloaded.parameters(), strict=True):
        assert torch.equal(p, q)


def test_state_json_is_plain_json(tmp_path: Path, trained) -> None:
    ckpt = save(tmp_path, 12, *trained)
    assert json.loads((ckpt / "state.json").read_text()) == {
        "schema_version": 3,
        "step": 12,
        "policy_version": 1,
        "data_position": {"epoch": 0, "offset": 16},
        "pending": [],
    }
    assert read_checkpoint_state(ckpt).step == 12


def test_an_asynchronous_runs_pending_prompts_round_trip(tmp_path: Path, trained) -> None:
    ckpt = save(tmp_path, 5, *trained)
    pending = [{"epoch": 0, "offset": 12}, {"epoch": 0, "offset": 14}]
    (ckpt / "state.json").write_text(json.dumps({**STATE.to_json(), "pending": pending}))
    state = read_checkpoint_state(ckpt)
    assert state.pending == (DataPosition(0, 12), DataPosition(0, 14))
    assert RunState.from_json(state.to_json(), ckpt) == state
    for bad in ({"epoch": 0}, {"epoch": 0, "offset": -2}, 3):
        (ckpt / "state.json").write_text(json.dumps({**STATE.to_json(), "pending": [bad]}))
        with pytest.raises(UserError, match=r"state\.json is not a checkpoint state"):
            read_checkpoint_state(ckpt)
    # STATE's sampler is at (0, 16): a pending draw twice, out of order, or at/after it is refused
    twice, backwards = [{"epoch": 0, "offset": 3}] * 2, [{"epoch": 0, "offset": o} for o in (5, 4)]
    for bad in (twice, backwards, [{"epoch": 0, "offset": 16}], [{"epoch": 1, "offset": 0}]):
        (ckpt / "state.json").write_text(json.dumps({**STATE.to_json(), "pending": bad}))
        with pytest.raises(UserError, match=r"pending positions not in draw order"):
            read_checkpoint_state(ckpt)


def test_latest_follows_the_newest_save(tmp_path: Path, trained) -> None:
    save(tmp_path, 1, *trained)
    second = save(tmp_path, 2, *trained)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002\n"
    assert latest_checkpoint(tmp_path) == second
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1, 2]


def test_crash_while_saving_the_model_leaves_the_previous_checkpoint(
    tmp_path: Path, trained, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer, optimizer, scheduler = trained
    first = save(tmp_path, 1, model, tokenizer, optimizer, scheduler)

    real_save = model.save_pretrained

    def crash_midway(save_directory, **kwargs):
        real_save(save_directory, **kwargs)  # the weights are on disk...
        raise OSError("No space left on device")  # ...but the config/tokenizer never are

    monkeypatch.setattr(model, "save_pretrained", crash_midway)
    with pytest.raises(OSError, match="No space left"):
        save(tmp_path, 2, model, tokenizer, optimizer, scheduler)

    ckpt_root = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt_root.iterdir()) == ["latest", "step_000001"]
    assert (ckpt_root / "latest").read_text() == "step_000001\n"
    assert latest_checkpoint(tmp_path) == first


def test_leftovers_of_a_killed_save_are_ignored_then_cleaned(tmp_path: Path, trained) -> None:
    first = save(tmp_path, 1, *trained)
    # A process killed mid-save leaves its temporary directory and maybe a temp pointer file.
    leftover = tmp_path / "checkpoints" / ".tmp_step_000002.x1y2"
    (leftover / "model").mkdir(parents=True)
    (leftover / "model" / "model.safetensors").write_bytes(b"\x00" * 10)
    (tmp_path / "checkpoints" / ".tmp_latest.abc").write_text("step_000002")

    assert latest_checkpoint(tmp_path) == first
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]
    save(tmp_path, 2, *trained)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_000001", "step_000002"]


def test_crash_before_latest_is_written_keeps_latest_valid(
    tmp_path: Path, trained, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(tmp_path, 1, *trained)

    def fail(path, text):
        raise OSError("killed")

    monkeypatch.setattr(checkpoint, "write_text_atomic", fail)
    with pytest.raises(OSError, match="killed"):
        save(tmp_path, 2, *trained)
    # The new directory is complete (it was renamed into place); latest still names step 1.
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000001\n"
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000001"
    assert read_checkpoint_state(tmp_path / "checkpoints" / "step_000002").step == 2


def test_keep_last_deletes_older_checkpoints(tmp_path: Path, trained) -> None:
    for step in (1, 2, 3, 4):
        save(tmp_path, step, *trained, keep_last=2)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [3, 4]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step_000003",
        "step_000004",
    ]


def test_saving_the_same_step_again_replaces_it(tmp_path: Path, trained) -> None:
    save(tmp_path, 3, *trained, dataclasses.replace(STATE, policy_version=3))
    ckpt = save(tmp_path, 3, *trained, dataclasses.replace(STATE, policy_version=4))
    assert read_checkpoint_state(ckpt).policy_version == 4
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000003"]


def test_bad_state_writes_nothing(tmp_path: Path, trained) -> None:
    model, tokenizer, optimizer, scheduler = trained
    with pytest.raises(TypeError):
        save_checkpoint(
            tmp_path, {"path": Path("x")}, Trainer(model, optimizer, scheduler), tokenizer
        )
    with pytest.raises(ValueError, match="step must be >= 0"):
        save(tmp_path, -1, *trained)
    with pytest.raises(ValueError, match="keep_last"):
        save(tmp_path, 1, *trained, keep_last=0)
    assert latest_checkpoint(tmp_path) is None


def test_latest_naming_a_missing_directory_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000009\n")
    with pytest.raises(UserError, match="step_000009"):
        latest_checkpoint(tmp_path)


def test_incomplete_or_corrupt_checkpoints_are_user_errors(tmp_path: Path, trained) -> None:
    model, tokenizer, optimizer, scheduler = trained
    with pytest.raises(UserError, match="does not exist"):
        load(tmp_path / "checkpoints" / "step_000001", optimizer, scheduler)

    ckpt = save(tmp_path, 1, model, tokenizer, optimizer, scheduler)
    (ckpt / "trainer_state.pt").write_bytes(b"not a torch file")
    with pytest.raises(UserError, match=r"trainer_state\.pt is corrupt"):
        load(ckpt, optimizer, scheduler)

    (ckpt / "state.json").write_text("{truncated")
    with pytest.raises(UserError, match=r"state\.json is corrupt"):
        load(ckpt, optimizer, scheduler)

    (ckpt / "trainer_state.pt").unlink()
    with pytest.raises(UserError, match=r"incomplete \(no trainer_state\.pt\)"):
        load(ckpt, optimizer, scheduler)


def test_optimizer_of_another_model_is_a_user_error(tmp_path: Path, trained) -> None:
    ckpt = save(tmp_path, 1, *trained)
    other = torch.nn.Linear(2, 2)
    optimizer, scheduler = _optimizer_and_scheduler(other)
    with pytest.raises(UserError, match="does not fit this run"):
        load(ckpt, optimizer, scheduler)


def test_write_json_atomic_replaces_whole_files(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "summary.json"
    write_json_atomic(path, {"b": 1, "a": [1.5, "x"]})
    write_json_atomic(path, {"c": 2})
    assert json.loads(path.read_text()) == {"c": 2}
    assert [p.name for p in path.parent.iterdir()] == ["summary.json"]
    assert path.stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
    write_json_atomic(path, {"nan": float("nan"), "nested": {"inf": [1.0, float("inf")]}})
    assert json.loads(path.read_text()) == {"nan": None, "nested": {"inf": [1.0, None]}}
    with pytest.raises(TypeError):
        write_json_atomic(path, {"path": Path("x")})
    assert json.loads(path.read_text())["nan"] is None  # the failed write changed nothing


def test_model_folder_is_replaced_whole(tmp_path: Path, trained) -> None:
    # The run's sft_model/ and final_model/ are written this way: a second save replaces the
    # first without leaving temporary folders, and the result loads.
    model, tokenizer, _, _ = trained
    folder = tmp_path / "final_model"
    save_model_atomic(model, tokenizer, folder)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    save_model_atomic(model, tokenizer, folder)
    assert [p.name for p in tmp_path.iterdir()] == ["final_model"]
    reloaded = Qwen2ForCausalLM.from_pretrained(folder)
    torch.testing.assert_close(reloaded.model.norm.weight, model.model.norm.weight)


def test_crash_while_saving_a_model_folder_keeps_the_old_one(
    tmp_path: Path, trained, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer, _, _ = trained
    folder = tmp_path / "final_model"
    save_model_atomic(model, tokenizer, folder)
    before = sorted(p.name for p in folder.iterdir())
    monkeypatch.setattr(tokenizer, "save_pretrained", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        save_model_atomic(model, tokenizer, folder)
    assert [p.name for p in tmp_path.iterdir()] == ["final_model"]
    assert sorted(p.name for p in folder.iterdir()) == before


def test_a_state_json_written_before_schema_versions_loads_as_version_1(tmp_path, trained) -> None:
    ckpt = save(tmp_path, 40, *trained)
    # What every checkpoint held before state.json had a schema version (sorted keys, no version).
    old = {"data_position": {"epoch": 2, "offset": 448}, "policy_version": 40, "step": 40}
    (ckpt / "state.json").write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")
    state = read_checkpoint_state(ckpt)
    assert state == RunState(40, 40, DataPosition(epoch=2, offset=448), schema_version=1)


def test_a_newer_schema_version_or_a_malformed_state_is_one_clear_error(tmp_path, trained) -> None:
    ckpt = save(tmp_path, 3, *trained)
    newer = {**STATE.to_json(), "schema_version": 7}
    (ckpt / "state.json").write_text(json.dumps(newer))
    with pytest.raises(
        UserError, match=r"schema version 7, but this treadle reads versions up to 3"
    ):
        read_checkpoint_state(ckpt)
    for bad in (0, -5, "2", True):  # not a schema version: one line naming the field
        (ckpt / "state.json").write_text(json.dumps({**STATE.to_json(), "schema_version": bad}))
        with pytest.raises(UserError, match=r"schema_version .* is not a schema version"):
            read_checkpoint_state(ckpt)
    negative = {**STATE.to_json(), "data_position": {"epoch": 0, "offset": -1}}
    for broken in ({"step": 3}, {**STATE.to_json(), "step": "3"}, [3], {**STATE.to_json(),
                   "step": -1}, {**STATE.to_json(), "step": 2.0}, negative):  # fmt: skip
        (ckpt / "state.json").write_text(json.dumps(broken))
        with pytest.raises(UserError, match=r"state\.json is not a checkpoint state"):
            read_checkpoint_state(ckpt)
