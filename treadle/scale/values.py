"""Checks of single values held by the scale model's dataclasses (:class:`~.shapes.ModelShape`,
:class:`~.hardware.Gpu`, ``Workload``, ``Setup``, ``Question``), for callers of the Python API:
the CLI's parsers and range checks only ever give values of the right kind, but a dataclass
built in Python can hold a NaN, a negative count or a float where a count is meant, which the
arithmetic would turn into a negative step time or a traceback. Each raises
:class:`~treadle.core.errors.UserError` naming the field (and the option that sets it)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from treadle.core.errors import UserError


def _shown(value: object) -> str:
    """``repr(value)`` cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _figure(x: float) -> str:
    """``x`` as a range's end is written: a whole number with thousands separators (16,384),
    else its shortest form (0.5, 1e+18)."""
    return f"{int(x):,}" if math.isfinite(x) and x == int(x) and abs(x) < 1e15 else f"{x:g}"


def number(label: str, value: object, low: float, high: float = math.inf, *,
           integer: bool = False, above: bool = False) -> None:  # fmt: skip
    """Raises UserError naming ``label`` unless ``value`` is a number (an ``int`` where
    ``integer``; never a bool) with ``low <= value <= high`` (``low < value`` where ``above``).
    NaN fails every range; an infinity fails any finite ``high``, and ``high`` infinite still
    refuses it (no count or time is infinite)."""
    kind = isinstance(value, int) if integer else isinstance(value, (int, float))
    # an int is finite however large (math.isfinite cannot take one past a float's range)
    ok = kind and not isinstance(value, bool) and (isinstance(value, int) or math.isfinite(value))
    if ok and (low < value if above else low <= value) and value <= high:
        return
    what = "an integer" if integer else "a finite number"
    lo, hi = _figure(low), _figure(high)
    if math.isinf(high):
        where = f"above {lo}" if above else f"at least {lo}"
    else:
        where = f"above {lo} and at most {hi}" if above else f"in {lo}..{hi}"
    raise UserError(f"{label} {_shown(value)}: must be {what} {where}")


def kind(label: str, value: object, *, integer: bool = False) -> None:
    """Raises UserError naming ``label`` unless ``value`` is an ``int`` (``integer``) or a number
    (never a bool); its range is left to the checks that name the option (NaN passes here)."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise UserError(f"{label} {_shown(value)}: must be "
                        f"{'an integer' if integer else 'a number'}")  # fmt: skip
    if not integer and isinstance(value, int) and abs(value) > 1e300:  # past a float's range
        raise UserError(f"{label} {_shown(value)}: must be a number below 1e300")


def choice(label: str, value: object, choices: Iterable[object]) -> None:
    """Raises UserError naming ``label`` unless ``value`` is one of ``choices``."""
    choices = tuple(choices)
    if not any(type(value) is type(c) and value == c for c in choices):
        raise UserError(f"{label} {_shown(value)}: must be one of "
                        f"{', '.join(map(repr, choices))}")  # fmt: skip
