"""One-field rules declared beside their fields, and the walk that checks them.

A numeric field states its bounds where it is declared, ``n: int = bounded(at_least(1),
default=8)``; :func:`check_fields` walks the config tree after loading and refuses the first
value that breaks a rule, naming it by the dotted path the walk took (``data.mix[1].weight``).
Rules that relate two fields are named functions in :mod:`treadle.config.checks`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from treadle.core.errors import UserError

_RULES = "rules"
"""Key of a field's rules in its ``dataclasses.field`` metadata."""


@dataclass(frozen=True)
class Rule:
    """What one field's value must satisfy; a value refused by ``ok`` fails the load with
    ``config <dotted key>: <says>, got <value>``."""

    ok: Callable[[float], bool]
    """True for an acceptable value."""
    says: str
    """What the value must be, e.g. ``must be at least 1 (and finite)``."""


def bounded(*rules: Rule, default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field checked against ``rules`` in order (no ``default``: a required field)."""
    return dataclasses.field(default=default, metadata={_RULES: rules})


def _says(text: str, why: str) -> str:
    return f"{text} ({why})" if why else text


def at_least(least: float) -> Rule:
    """``value >= least`` and finite (nan and inf are refused too)."""
    return Rule(lambda v: math.isfinite(v) and v >= least, f"must be at least {least} (and finite)")


def at_most(most: float) -> Rule:
    """``value <= most`` (nan is refused)."""
    return Rule(lambda v: v <= most, f"must be at most {most}")


def above(limit: float, why: str = "") -> Rule:
    """``value > limit`` (nan is refused, inf is not)."""
    return Rule(lambda v: v > limit, _says(f"must be above {limit}", why))


def below(limit: float, why: str = "") -> Rule:
    """``value < limit`` (nan is refused)."""
    return Rule(lambda v: v < limit, _says(f"must be below {limit}", why))


def positive(why: str = "") -> Rule:
    """``value > 0`` (nan is refused, inf is not: pair it with :func:`finite`)."""
    return Rule(lambda v: v > 0, _says("must be positive", why))


def finite() -> Rule:
    """Neither nan nor infinite."""
    return Rule(math.isfinite, "must be a finite number")


def off_or_above(limit: float) -> Rule:
    """0 (the feature is off) or ``value > limit``."""
    return Rule(lambda v: v == 0 or v > limit, f"must be above {limit} (or 0 for off)")


def only(value: float, why: str) -> Rule:
    """Exactly ``value`` (the one setting the code supports)."""
    return Rule(lambda v: v == value, _says(f"only {value} is supported", why))


def rules_of(field: dataclasses.Field) -> tuple[Rule, ...]:
    """The rules declared on ``field`` (empty for a field declared without :func:`bounded`)."""
    return field.metadata.get(_RULES, ())


def check_fields(node: Any, path: str = "") -> None:
    """Check every field of the config dataclass ``node``, and of every section (or list of
    sections) below it, against its declared rules, in declaration order, depth first.

    Raises:
        UserError: ``config <dotted key>: <what it must be>, got <value>`` for the first value
            that breaks a rule.
    """
    for f in dataclasses.fields(node):
        key = f"{path}.{f.name}" if path else f.name
        value = getattr(node, f.name)
        for rule in rules_of(f):
            if not rule.ok(value):
                raise UserError(f"config {key}: {rule.says}, got {value}")
        if dataclasses.is_dataclass(value):
            check_fields(value, key)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    check_fields(item, f"{key}[{i}]")
