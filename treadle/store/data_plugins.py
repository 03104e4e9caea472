"""A user's own data loader, named in a recipe by import path: ``data.source:
mypkg.data:load_tasks`` (or ``data.mix[i].source``).

The one signature: ``load_tasks(cfg: SourceConfig) -> Sequence[Task]``. The loader gets its
section of the config (a :class:`~treadle.config.SourceConfig`: ``path``, ``size``, ``domain``,
``eval_size``, the field names, ...) and returns every task it has, in a fixed order, each a
:class:`~treadle.core.types.Task` with a unique ``task_id``. treadle makes the split as for a
file: the last ``eval_size`` tasks are held out (those whose messages also appear among the
training tasks are dropped), and training uses at most ``size`` of the rest.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from treadle.config import SourceConfig
from treadle.core.errors import UserError
from treadle.core.plugins import import_path
from treadle.core.types import Task

LOADER_KIND = "a data loader, load_tasks(cfg: SourceConfig) -> Sequence[Task]"


def loaded_split(cfg: SourceConfig) -> tuple[list[Task], list[Task]]:
    """The training and held-out tasks of the loader ``cfg.source`` names.

    Raises:
        UserError: one line naming ``data.source``: a bad import path (see
            :func:`~treadle.core.plugins.import_path`), a loader that does not take ``(cfg)``,
            that raises, or that returns anything but a sequence of Tasks with unique ids, or
            too few tasks to hold out ``eval_size``.
    """
    tasks = load_tasks(cfg)
    if len(tasks) <= cfg.eval_size:
        raise UserError(
            f"config data.source={cfg.source!r}: the loader returned {len(tasks)} tasks, need "
            f"more than data.eval_size={cfg.eval_size} (the held-out split); lower it"
        )
    held_out = tasks[len(tasks) - cfg.eval_size :] if cfg.eval_size else []
    train = tasks[: len(tasks) - cfg.eval_size][: cfg.size]
    seen = {t.messages for t in train}
    return train, [t for t in held_out if t.messages not in seen]


def load_tasks(cfg: SourceConfig) -> list[Task]:
    """Every task the loader ``cfg.source`` returns, checked.

    Raises:
        UserError: see :func:`loaded_split`.
    """
    what = f"data.source={cfg.source!r}"
    loader = import_path(cfg.source, what)
    try:
        inspect.signature(loader).bind(cfg)
    except TypeError:
        raise UserError(
            f"config {what}: {getattr(loader, '__name__', loader)}{inspect.signature(loader)} "
            f"cannot be called with the source's config; {LOADER_KIND}"
        ) from None
    except ValueError:  # no signature to read (a builtin): found when it is called
        pass
    try:
        tasks = loader(cfg)
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"config {what}: the loader raised {type(e).__name__}: {e}") from None
    if isinstance(tasks, str | bytes) or not isinstance(tasks, Sequence):
        raise UserError(
            f"config {what}: the loader returned {type(tasks).__name__}, not a list; {LOADER_KIND}"
        )
    for i, task in enumerate(tasks):
        if not isinstance(task, Task):
            raise UserError(
                f"config {what}: item {i} the loader returned is a {type(task).__name__}, not a "
                "treadle.core.types.Task"
            )
        if not isinstance(task.messages, tuple) or not task.messages:
            raise UserError(
                f"config {what}: task {task.task_id!r} has messages of type "
                f"{type(task.messages).__name__}; give a non-empty tuple of Message"
            )
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise UserError(f"config {what}: task_id {twice!r} appears twice; make the ids unique")
    return list(tasks)
