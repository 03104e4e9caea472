"""A user's own code named in a recipe: ``package.module:Name`` where a built-in name may go.

Every kind of plug-in (reward function, data loader, inference engine, environment, outside
agent) is loaded by :func:`import_path` and checked against its Protocol by
:func:`require_methods` before a run directory exists; each error is one line that names the
config key, its value and the fix. Loading is lazy: nothing is imported until a config names it.

Modules are found on ``sys.path`` and, as uvicorn finds its apps, in the current directory
(``treadle train`` run where the user's code is). Processes started later with ``spawn`` (the
reward pool's workers) inherit that ``sys.path``, so they import the same module.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from treadle.core.errors import UserError


def is_import_path(name: str) -> bool:
    """Whether ``name`` reads as ``package.module:Name`` rather than a built-in's name."""
    return ":" in name


def import_path(path: str, what: str) -> Callable[..., Any]:
    """The callable (a class or function) at ``package.module:Attribute``.

    Args:
        path: ``package.module:Attribute`` (``Attribute`` may be dotted: ``mod:Outer.inner``).
        what: The config key and its value, for errors (e.g. ``reward.functions[0].name='m:F'``).

    Raises:
        UserError: not such a path (no colon, or two), a relative module, no such module (or
            it fails at import: a SyntaxError, an exception at its top level), no such
            attribute, or not callable. One line each.
    """
    module, sep, attribute = path.partition(":")
    if not sep or not module or not attribute or ":" in attribute:
        raise UserError(f"config {what}: expected an import path package.module:Name (one colon)")
    if module.startswith("."):  # importlib would ask for a package to be relative to
        raise UserError(
            f"config {what}: {module!r} is a relative module; give its full dotted name, from a "
            "folder on PYTHONPATH or the current directory"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `treadle train` run where the user's code is
    try:
        found: Any = importlib.import_module(module)
    except ImportError as e:
        raise UserError(
            f"config {what}: cannot import {module!r} ({e}); is its package installed, on "
            "PYTHONPATH or in the current directory?"
        ) from None
    except Exception as e:  # the module itself fails (a SyntaxError, an error at import)
        message = str(e).splitlines()[0] if str(e) else ""
        raise UserError(
            f"config {what}: importing {module!r} failed: {type(e).__name__}: {message}"
        ) from None
    for part in attribute.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise UserError(f"config {what}: module {module!r} has no {attribute!r}")
    if not callable(found):
        raise UserError(f"config {what}: {attribute!r} is not callable (a class or function)")
    return found


def require_methods(obj: object, methods: Mapping[str, str], what: str, kind: str) -> None:
    """That ``obj`` (a class or an instance) has every method a Protocol asks for.

    Args:
        obj: The plug-in's class (checked before it is built) or an instance.
        methods: Method name -> how it is called, e.g. ``{"score": "score(task, response)"}``.
        what: The config key and its value, for errors.
        kind: What the plug-in is and where its Protocol lives, e.g. ``"a reward function
            (treadle.rewards.base.RewardFunction)"``.

    Raises:
        UserError: the first missing method, in one line, e.g. ``config
            reward.functions[0].name='m:Gold': class Gold has no method score(task, response);
            a reward function (...) needs score(task, response)``.
    """
    for method, call in methods.items():
        if not callable(getattr(obj, method, None)):
            owner = obj if inspect.isclass(obj) else type(obj)
            needs = ", ".join(methods.values())
            raise UserError(
                f"config {what}: class {owner.__name__} has no method {call}; {kind} needs {needs}"
            )
