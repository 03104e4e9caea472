"""Environments by name or import path: ``environment.name`` in a recipe.

A name is one treadle ships (:data:`BUILTIN`) or one a user's code registered
(:func:`register`); anything else is read as ``package.module:Attribute``, a factory called once
per episode with ``environment.kwargs``, loaded by :func:`treadle.core.plugins.import_path` as
every plug-in is.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from treadle.core.errors import UserError
from treadle.core.plugins import import_path, require_methods
from treadle.rollout.environments.base import Environment, SyncEnvironment, Threaded

BUILTIN = {
    "calculator": "treadle.rollout.environments.calculator:calculator",
    "frozen_lake": "treadle.rollout.environments.frozen_lake:FrozenLake",
    "guess_number": "treadle.rollout.environments.guess_number:GuessNumber",
    "python_tests": "treadle.rollout.environments.python_tests:PythonTests",
}
"""The environments treadle ships, by name -> import path."""

ENVIRONMENT_METHODS = {
    "reset": "reset(task)",
    "step": "step(turn)",
    "reward": "reward()",
    "close": "close()",
}
"""The methods an environment has (:class:`~treadle.rollout.environments.base.Environment`)."""
ENVIRONMENT_KIND = "an environment (treadle.rollout.environments.base.Environment)"

EnvironmentFactory = Callable[..., Environment | SyncEnvironment]

_REGISTRY: dict[str, EnvironmentFactory] = {}


def register(name: str, factory: EnvironmentFactory) -> None:
    """Make ``factory(**kwargs)`` available as ``environment.name: <name>``.

    Raises:
        UserError: ``name`` is taken by another factory.
    """
    if name in BUILTIN or _REGISTRY.get(name, factory) is not factory:
        raise UserError(f"environment {name!r} is registered already; choose another name")
    _REGISTRY[name] = factory


def resolve(spec: str) -> EnvironmentFactory:
    """The factory registered as ``spec``, or imported from ``package.module:Attribute``.

    Raises:
        UserError: no such name, module or attribute (the error names the spec and the fix).
    """
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if ":" not in BUILTIN.get(spec, spec):
        known = ", ".join(sorted({*BUILTIN, *_REGISTRY}))
        raise UserError(
            f"config environment.name={spec!r}: not a registered environment ({known}) nor an "
            "import path package.module:Class"
        )
    return import_path(BUILTIN.get(spec, spec), f"environment.name={spec!r}")


def check(spec: str, kwargs: Mapping[str, Any] | None = None) -> None:
    """That ``spec`` names a factory and it takes ``kwargs`` (nothing is built).

    Raises:
        UserError: see :func:`resolve`; or the factory's signature does not take ``kwargs``.
    """
    factory = resolve(spec)
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: found at make()
        return
    given = dict(kwargs or {})
    params = signature.parameters.values()
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        unknown = sorted(set(given) - {p.name for p in params})
        if unknown:
            known = ", ".join(p.name for p in params) or "none"
            raise UserError(
                f"config environment.kwargs for {spec!r}: unknown {', '.join(unknown)} (it takes "
                f"{known})"
            )
    try:
        signature.bind(**given)
    except TypeError as e:
        raise UserError(f"config environment.kwargs for {spec!r}: {e}") from None


def make(
    spec: str, kwargs: Mapping[str, Any] | None = None, pool: ThreadPoolExecutor | None = None
) -> Environment:
    """One episode's environment from its name or import path and keyword arguments; a
    synchronous one is wrapped in :class:`Threaded` over ``pool``.

    Raises:
        UserError: see :func:`resolve`; the factory rejects the arguments or raises; what it
            builds is neither an :class:`Environment` nor a synchronous one; or it is
            synchronous and no pool is given.
    """
    factory = resolve(spec)
    try:
        env = factory(**dict(kwargs or {}))
    except TypeError as e:
        raise UserError(f"config environment.kwargs for {spec!r}: {e}") from None
    except Exception as e:  # the user's factory fails on its kwargs: one line, as for a reward
        raise UserError(
            f"config environment.name={spec!r}: building it with environment.kwargs failed: "
            f"{type(e).__name__}: {e}"
        ) from None
    require_methods(env, ENVIRONMENT_METHODS, f"environment.name={spec!r}", ENVIRONMENT_KIND)
    methods = tuple(ENVIRONMENT_METHODS)
    if all(inspect.iscoroutinefunction(getattr(env, m)) for m in methods):
        return env  # type: ignore[return-value]  # an Environment (checked above)
    if any(inspect.iscoroutinefunction(getattr(env, m)) for m in methods):
        raise UserError(
            f"config environment.name={spec!r}: {type(env).__name__} mixes async and plain "
            "methods; make reset, step, reward and close all async or all plain"
        )
    if pool is None:
        raise UserError(f"environment {spec!r} is synchronous: give make() a thread pool")
    return Threaded(env, pool)  # type: ignore[arg-type]  # a SyncEnvironment (checked above)
