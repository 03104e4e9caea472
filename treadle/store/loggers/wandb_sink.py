"""Weights & Biases (``run.loggers: [wandb]``; ``pip install 'treadle[wandb]'``).

The run's files are under ``RUN/wandb/``. wandb reads its own environment: ``WANDB_MODE=offline``
logs to those files without a network or a login (``wandb sync RUN/wandb/offline-run-*``
uploads them later), ``WANDB_API_KEY`` / ``wandb login`` for online use, ``WANDB_ENTITY``.
The wandb run id is kept in ``RUN/wandb/treadle_run_id``, so ``treadle train --resume RUN``
continues the same wandb run.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from treadle.core.errors import UserError
from treadle.store.loggers import RunIdentity

WANDB_DIRNAME = "wandb"
RUN_ID_FILENAME = "treadle_run_id"
STEP_KEY = "step"
"""Every row carries the RL step under this key, the x axis of every metric: wandb's own
``_step`` only grows, so the steps a resume logs again (after an older checkpoint) are kept
and shown at their step instead of being dropped."""


_OFFLINE_MODES = ("offline", "disabled", "dryrun")


def check_can_start() -> None:
    """Refuse at start-up (before the run directory and the SFT warm-up) a wandb that can only
    fail: online, with no credentials anywhere wandb looks. Conservative: any API key,
    ``~/.netrc``, wandb settings file or identity token lets the run go on to ``wandb.init``,
    which reports what is still wrong (a wrong key, no network after its own timeout).

    Raises:
        UserError: ``WANDB_MODE`` is not offline and no credentials exist.
    """
    env = os.environ
    if env.get("WANDB_MODE", "").lower() in _OFFLINE_MODES or env.get("WANDB_DISABLED"):
        return
    home = Path.home()
    config_dir = Path(env.get("WANDB_CONFIG_DIR", home / ".config" / "wandb"))
    places = [Path(env.get("NETRC", home / ".netrc")), config_dir / "settings"]
    places.append(Path("wandb") / "settings")  # a project's own settings (e.g. mode = offline)
    given = ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE")
    if any(env.get(v) for v in given) or any(p.is_file() for p in places):
        return
    raise UserError(
        "run.loggers wandb: no wandb credentials (no WANDB_API_KEY, no `wandb login`) and "
        "WANDB_MODE is not offline; set WANDB_MODE=offline to log to RUN/wandb without a "
        "network, or run `wandb login`"
    )


def _run_id(folder: Path) -> tuple[str, bool]:
    """The wandb run id of this run directory and whether it was there (a resumed run)."""
    path = folder / RUN_ID_FILENAME
    if path.is_file():
        return path.read_text(encoding="utf-8").strip(), True
    run_id = secrets.token_hex(4)  # wandb ids: [a-z0-9], at most 64 characters
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n", encoding="utf-8")
    return run_id, False


class WandbSink:
    """Metrics to a wandb run named ``run.name`` in project ``run.project`` (a
    :class:`MetricsSink`)."""

    def __init__(self, identity: RunIdentity) -> None:
        """Start (or, when ``RUN/wandb`` has this run's id, resume) the wandb run, with the
        config recorded as its config.

        Raises:
            UserError: wandb could not start the run (no login and no network, say).
        """
        import wandb

        folder = identity.run_dir / WANDB_DIRNAME
        run_id, resumed = _run_id(folder)
        try:
            self._run = wandb.init(
                project=identity.project,
                name=identity.name,
                dir=str(identity.run_dir),  # wandb makes its wandb/ folder inside
                config=identity.config,
                id=run_id,
                resume="allow" if resumed else None,
                settings=wandb.Settings(console="off", quiet=True),  # the terminal is treadle's
            )
        except Exception as e:  # wandb raises its own errors for login and network failures
            raise UserError(
                f"run.loggers wandb: wandb could not start the run ({type(e).__name__}: {e}); "
                "set WANDB_MODE=offline to log to RUN/wandb without a network, or run "
                "`wandb login`"
            ) from None
        self._run.define_metric(STEP_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)
        self._finished = False

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Log one row ``{step, **values}``."""
        if self._finished:
            raise RuntimeError("the wandb run is finished")
        self._run.log({STEP_KEY: step, **values})

    def rewind(self, purge_step: int) -> None:
        """Nothing to hide: wandb keeps the rows past ``purge_step``; the steps logged again
        follow them (see :data:`STEP_KEY`)."""

    def close(self) -> None:
        """Finish the wandb run and stop wandb's service process, which is when the run's
        files are complete (``finish`` alone may return before the offline ``.wandb`` file is
        written out); idempotent."""
        if not self._finished:
            import wandb

            self._finished = True
            self._run.finish()
            wandb.teardown()
