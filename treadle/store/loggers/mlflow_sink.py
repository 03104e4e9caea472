"""MLflow (``run.loggers: [mlflow]``; ``pip install 'treadle[mlflow]'``, mlflow-skinny).

The run goes to ``MLFLOW_TRACKING_URI`` when that is set, else to a file store in
``RUN/mlruns`` (``mlflow ui --backend-store-uri RUN/mlruns`` shows it). Its MLflow run id is kept
in ``RUN/mlflow_run_id``, so ``treadle train --resume RUN`` continues the same MLflow run.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from typing import Any

from treadle.core.errors import UserError
from treadle.store.loggers import RunIdentity

MLRUNS_DIRNAME = "mlruns"
RUN_ID_FILENAME = "mlflow_run_id"
_BAD_CHARS = re.compile(r"[^\w\-. :/]")


def mlflow_name(metric: str) -> str:
    """An MLflow-legal metric name (alphanumerics, ``_ - . : /`` and spaces):
    ``"eval/pass@1"`` -> ``"eval/pass_at_1"``; any other character becomes ``_``."""
    return _BAD_CHARS.sub("_", metric.replace("@", "_at_"))


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"run": {"seed": 0}}`` -> ``{"run.seed": "0"}``: the config as MLflow params."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out |= flat_params(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = str(value)[:6000]  # MLflow's limit on a param's value
    return out


class MlflowSink:
    """Metrics to an MLflow run named ``run.name`` in experiment ``run.project`` (a
    :class:`MetricsSink`); metric names are made legal by :func:`mlflow_name`."""

    def __init__(self, identity: RunIdentity) -> None:
        """Start (or, when ``RUN/mlflow_run_id`` exists, resume) the MLflow run; a new run
        records the config as params and as the artifact ``config.json``.

        Raises:
            UserError: the tracking server refused (or could not be reached).
        """
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (identity.run_dir / MLRUNS_DIRNAME).resolve().as_uri()
            # MLflow 3 refuses its file store unless asked for it: this is the store asked for
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        id_path = identity.run_dir / RUN_ID_FILENAME
        try:
            self._client = MlflowClient(tracking_uri=uri)
            if id_path.is_file():
                self._run_id = id_path.read_text(encoding="utf-8").strip()
                self._client.update_run(self._run_id, status="RUNNING")
            else:
                self._run_id = self._start(identity)
                id_path.write_text(self._run_id + "\n", encoding="utf-8")
        except Exception as e:  # MlflowException, or the HTTP client's for a remote server
            raise UserError(
                f"run.loggers mlflow: MLflow at {uri} could not start the run "
                f"({type(e).__name__}: {e}); check MLFLOW_TRACKING_URI, or unset it to log to "
                "RUN/mlruns"
            ) from None
        self._closed = False

    def _start(self, identity: RunIdentity) -> str:
        from mlflow.entities import Param

        experiment = self._client.get_experiment_by_name(identity.project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self._client.create_experiment(identity.project)
        )
        run_id = self._client.create_run(experiment_id, run_name=identity.name).info.run_id
        params = [Param(k, v) for k, v in flat_params(identity.config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self._client.log_batch(run_id, params=params[i : i + 100])
        self._client.log_dict(run_id, identity.config, "config.json")
        return run_id

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Log ``values`` at ``step`` in one batch (timestamps in ms)."""
        from mlflow.entities import Metric

        if self._closed:
            raise RuntimeError("the MLflow run is finished")
        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(k), float(v), now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            self._client.log_batch(self._run_id, metrics=metrics[i : i + 1000])

    def rewind(self, purge_step: int) -> None:
        """Nothing to hide: MLflow keeps the values past ``purge_step``; the steps logged
        again are added beside them (later timestamps)."""

    def close(self) -> None:
        """Mark the MLflow run finished; idempotent."""
        if not self._closed:
            self._closed = True
            self._client.set_terminated(self._run_id, status="FINISHED")
