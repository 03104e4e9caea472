"""Tests for treadle.store.loggers: the optional wandb and MLflow sinks, offline, read back from
the files they write, and the start-up check of ``run.loggers``."""

from __future__ import annotations

import importlib.util
import json
import re
import struct
from pathlib import Path

import pytest

from treadle.config import load_config
from treadle.core.errors import UserError
from treadle.store.loggers import SINKS, RunIdentity, open_sinks, require_installed
from treadle.store.loggers.mlflow_sink import flat_params, mlflow_name
from treadle.store.observe import MetricsLogger

DEFAULT = Path(__file__).resolve().parents[2] / "recipes" / "default.yaml"
CONFIG = {"run": {"name": "demo", "seed": 3}, "trainer": {"lr": 1e-5}}


def _identity(run_dir: Path) -> RunIdentity:
    return RunIdentity(run_dir, "demo", "treadle-tests", CONFIG)


def _log_steps(run_dir: Path, names: list[str], steps: range, resume_from: int | None = None):
    """Open the sinks the way a run does, log ``reward/mean = step / 10`` and an evaluation at
    each step, close."""
    with MetricsLogger(
        run_dir, tensorboard=False, sinks=open_sinks(names, _identity(run_dir))
    ) as m:
        if resume_from is not None:
            m.truncate_after(resume_from, rows_at_step=1)
        for step in steps:
            m.log(step, {"reward/mean": step / 10, "eval/pass@1": 0.5})


def test_the_default_is_tensorboard_and_an_unknown_logger_is_refused() -> None:
    assert load_config(DEFAULT).run.loggers == ["tensorboard"]
    assert load_config(DEFAULT, ["run.loggers=[tensorboard, wandb]"]).run.loggers == [
        "tensorboard",
        "wandb",
    ]
    with pytest.raises(UserError, match=re.escape("config run.loggers[1]: expected one of")):
        load_config(DEFAULT, ["run.loggers=[tensorboard, neptune]"])


@pytest.mark.parametrize(
    ("name", "install"), [("wandb", "'treadle[wandb]'"), ("mlflow", "'treadle[mlflow]'")]
)
def test_a_logger_that_is_not_installed_is_one_line_naming_its_extra(
    monkeypatch, name: str, install: str
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == SINKS[name].package else real(n, *a)
    )
    with pytest.raises(UserError) as e:
        require_installed(["tensorboard", name])
    assert str(e.value) == (
        f"config run.loggers: {name} is not installed; install it with pip install {install}, "
        f"or remove {name} from run.loggers"
    )


def test_train_checks_the_loggers_before_the_run_directory(tmp_path: Path, monkeypatch) -> None:
    from treadle.jobs.train import train

    monkeypatch.chdir(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "mlflow" else real(n, *a)
    )
    cfg = load_config(DEFAULT, ["rollout.engine=hf", "data.size=50", "data.eval_size=10",
                                "run.loggers=[tensorboard, mlflow]"])  # fmt: skip
    with pytest.raises(UserError, match=re.escape("pip install 'treadle[mlflow]'")):
        train(cfg)
    assert list(tmp_path.iterdir()) == []  # no run directory


def _no_wandb_credentials(monkeypatch, home: Path) -> None:
    monkeypatch.setenv("HOME", str(home))
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED", "WANDB_IDENTITY_TOKEN_FILE",
                "WANDB_CONFIG_DIR", "NETRC"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)


def test_wandb_online_without_credentials_is_refused_before_the_run_directory(
    tmp_path: Path, monkeypatch
) -> None:
    # It failed in wandb.init, after the run directory and the whole SFT warm-up (16 s for
    # one SFT step of a tiny run; the default recipe has 800).
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'treadle[wandb]')")
    from treadle.jobs.train import train

    _no_wandb_credentials(monkeypatch, tmp_path / "home")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(DEFAULT, ["rollout.engine=hf", "data.size=50", "data.eval_size=10",
                                "sft.steps=1", "run.loggers=[wandb]"])  # fmt: skip
    with pytest.raises(UserError, match=re.escape("run.loggers wandb: no wandb credentials")):
        train(cfg)
    assert list(tmp_path.iterdir()) == []  # no run directory


@pytest.mark.parametrize(
    "given", ["WANDB_MODE=offline", "WANDB_MODE=disabled", "WANDB_API_KEY=k", "netrc", "settings"]
)
def test_wandb_with_credentials_or_offline_goes_on_to_wandb(
    tmp_path: Path, monkeypatch, given: str
) -> None:
    from treadle.store.loggers.wandb_sink import check_can_start

    _no_wandb_credentials(monkeypatch, tmp_path)
    if "=" in given:
        monkeypatch.setenv(*given.split("="))
    elif given == "netrc":
        (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password k\n")
    else:  # a wandb settings file (it may say mode = offline): wandb.init reads it
        (tmp_path / ".config" / "wandb").mkdir(parents=True)
        (tmp_path / ".config" / "wandb" / "settings").write_text("[default]\nmode = offline\n")
    check_can_start()  # no error: wandb.init decides


# --- wandb, offline -------------------------------------------------------------------------

_BLOCK = 32 * 1024  # the LevelDB log format of wandb's .wandb files: 32 KiB blocks


def _wandb_records(path: Path):
    """The protobuf Records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version),
    then LevelDB log records (4-byte CRC, 2-byte length, 1-byte type: 1 full, 2 first,
    3 middle, 4 last), none crossing a 32 KiB block (a tail under 7 bytes is padding)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts + chunk)
            parts = b""
            yield record
        elif kind in (2, 3):
            parts += chunk


def _wandb_history(run_dir: Path) -> list[tuple[str, list[dict]]]:
    """(run id, history rows without wandb's own ``_`` keys) of each offline run, oldest first."""
    out = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        rows, run_id = [], None
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
                assert (record.run.display_name, record.run.project) == ("demo", "treadle-tests")
                config = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.run.config.update
                }
                assert config["trainer"] == {"lr": 1e-5} and config["run"]["seed"] == 3
            elif kind == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                rows.append({k: v for k, v in items.items() if not k.startswith("_")})
        out.append((run_id, rows))
    return out


@pytest.fixture
def offline_wandb(monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'treadle[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: no network
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def test_wandb_offline_writes_the_logged_values_and_a_resume_appends(
    tmp_path: Path, offline_wandb
) -> None:
    _log_steps(tmp_path, ["wandb"], range(3))
    ((run_id, rows),) = _wandb_history(tmp_path)
    assert run_id == (tmp_path / "wandb" / "treadle_run_id").read_text().strip()
    # reward/mean = step / 10 at steps 0, 1, 2, each row with its RL step
    assert rows == [{"step": s, "reward/mean": s / 10, "eval/pass@1": 0.5} for s in range(3)]

    # A resume from the checkpoint of step 1: the same wandb run, step 2 logged again, then 3.
    _log_steps(tmp_path, ["wandb"], range(2, 4), resume_from=1)
    (first_id, first), (second_id, second) = _wandb_history(tmp_path)
    assert first_id == second_id == run_id and first == rows
    assert second == [{"step": s, "reward/mean": s / 10, "eval/pass@1": 0.5} for s in (2, 3)]


# --- MLflow, a file store in the run directory -----------------------------------------------


def test_mlflow_names_and_params() -> None:
    assert mlflow_name("eval/pass@1") == "eval/pass_at_1"
    assert mlflow_name("time/generate_s") == "time/generate_s"
    assert mlflow_name("domain/math+code/reward") == "domain/math_code/reward"
    assert flat_params(CONFIG) == {"run.name": "demo", "run.seed": "3", "trainer.lr": "1e-05"}


def test_mlflow_logs_to_the_run_directory_and_a_resume_appends(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("mlflow", reason="mlflow is not installed: pip install 'treadle[mlflow]'")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _log_steps(tmp_path, ["mlflow"], range(3))
    run_id = (tmp_path / "mlflow_run_id").read_text().strip()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run(run_id)
    assert (run.info.run_name, run.info.status) == ("demo", "FINISHED")
    assert client.get_experiment(run.info.experiment_id).name == "treadle-tests"
    assert run.data.params == {"run.name": "demo", "run.seed": "3", "trainer.lr": "1e-05"}

    def history(name: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))

    assert history("reward/mean") == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert history("eval/pass_at_1") == [(0, 0.5), (1, 0.5), (2, 0.5)]
    _log_steps(tmp_path, ["mlflow"], range(2, 4), resume_from=1)
    # the same run; step 2 logged again beside the first one, then 3
    assert history("reward/mean") == [(0, 0.0), (1, 0.1), (2, 0.2), (2, 0.2), (3, 0.3)]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_every_sink_implements_the_protocol_and_opens_once(tmp_path: Path) -> None:
    import importlib

    for entry in SINKS.values():
        module, _, attr = entry.target.partition(":")
        if importlib.util.find_spec(entry.package) is None:
            continue  # its own test above says why it is not run
        cls = getattr(importlib.import_module(module), attr)
        assert [m for m in ("log", "rewind", "close") if not callable(getattr(cls, m))] == []
    sinks = open_sinks(["tensorboard", "tensorboard"], _identity(tmp_path))
    assert len(sinks) == 1  # a name given twice
    with MetricsLogger(tmp_path, tensorboard=False, sinks=sinks) as m:
        m.log(1, {"reward/mean": 0.5})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
