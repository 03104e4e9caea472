"""The run directory a run is given (treadle/jobs/compose.py ``prepare_run_dir``): a resumed run
keeps the model its checkpoints were saved from."""

from __future__ import annotations

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
    # what the checkpoint does not hold may change: how the adapter is synced, its dropout
    sync = load_config(
        run_dir / "config.yaml", ["model.lora.sync=adapter", "model.lora.dropout=0.1"]
    )
    assert prepare_run_dir(sync, run_dir) == run_dir
    # an old run's config.yaml: model.dtype, since renamed rollout.dtype (config/loading.py
    # moves it when loading), is not compared; a key added since (sync) is not either
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    saved["model"]["dtype"] = saved["rollout"].pop("dtype")
    del saved["model"]["lora"]["sync"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    old = load_config(run_dir / "config.yaml")
    assert old.rollout.dtype == cfg.rollout.dtype and prepare_run_dir(old, run_dir) == run_dir


def test_a_run_saved_before_entropy_agg_resumes_only_with_its_choice_said(tmp_path):
    # a run from before algorithm.entropy_agg existed: an entropy bonus under seq-mean-token-sum
    # was aggregated like the loss, which is no longer the default
    overrides = [f"run.output_dir={tmp_path}", "run.name=r", "algorithm.entropy_coef=0.01"]
    cfg = load_config(None, [*overrides, "algorithm.loss_agg=seq-mean-token-sum"])
    run_dir = prepare_run_dir(cfg, None)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    del saved["algorithm"]["entropy_agg"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(
        UserError, match=r"add algorithm\.entropy_agg=loss_agg to resume it as it was"
    ):
        prepare_run_dir(load_config(run_dir / "config.yaml"), run_dir)
    as_it_was = load_config(run_dir / "config.yaml", ["algorithm.entropy_agg=loss_agg"])
    assert prepare_run_dir(as_it_was, run_dir) == run_dir
    # under token-mean, or without a bonus, the two aggregations are one: nothing to say
    saved["algorithm"]["loss_agg"] = "token-mean"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    assert prepare_run_dir(load_config(run_dir / "config.yaml"), run_dir) == run_dir
