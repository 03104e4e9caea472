"""The run directory a run is given (treadle/jobs/compose.py ``prepare_run_dir``): a resumed run
keeps the model its checkpoints were saved from."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from treadle.config import load_config, to_dict
from treadle.core.errors import UserError
from treadle.jobs.compose import prepare_run_dir


def test_a_resume_that_changes_the_model_is_refused_before_anything_loads(tmp_path):
    cfg = load_config("recipes/lora.yaml", [f"run.output_dir={tmp_path}", "run.name=r"])
    run_dir = prepare_run_dir(cfg, None)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["model"] == to_dict(cfg)["model"]
    # run.* and trainer.* may change on resume: the same directory comes back
    longer = load_config(run_dir / "config.yaml", ["run.steps=80", "trainer.lr=1e-4"])
    assert prepare_run_dir(longer, run_dir) == run_dir
    # the adapters' rank may not: the checkpoint's adapter would load at its own rank (PEFT
    # reads it from the adapter's config) and the override would be silently ignored
    wider = load_config(run_dir / "config.yaml", ["model.lora.r=16"])
    with pytest.raises(UserError) as error:
        prepare_run_dir(wider, run_dir)
    r = cfg.model.lora.r
    assert str(error.value) == (
        f"--resume {run_dir}: model.lora.r=16 differs from the run's model.lora.r={r} (its "
        "checkpoints hold that model's weights); resume without that override, or start a new "
        "run"
    )
    # a key the saved config lacks (added to treadle since the run began) is not compared
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    del saved["model"]["lora"]["sync"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    other_sync = dataclasses.replace(cfg.model.lora, sync="adapter")
    newer = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=other_sync))
    assert prepare_run_dir(newer, run_dir) == run_dir
