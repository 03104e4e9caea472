"""Checks of single values held by the scale model's dataclasses (:class:`~.shapes.ModelShape`,
:class:`~.hardware.Gpu`, ``Workload``, ``Setup``, ``Question``), for callers of the Python API:
the CLI's parsers and range checks only ever give values of the right kind, but a dataclass
built in Python can hold a NaN, a negative count or a float where a count is meant, which the
arithmetic would turn into a negative step time or a traceback. Each raises
:class:`~treadle.core.errors.UserError` naming the field (and the option that sets it).

Numbers are :mod:`numbers`' kinds, so NumPy's scalars (``np.int64(8)``, ``np.float32(0.5)``) pass
as Python's do; a bool is never a number here (``True`` prompts is a mistake), and a flag is a
bool, Python's or NumPy's."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

from treadle.core.errors import UserError


def _shown(value: object) -> str:
    """``repr(value)`` cut to 40 characters (an int of over 4,300 digits, which Python will
    not write out, said as such)."""
    try:
        text = repr(value)
    except ValueError:
        return "an integer of over 4,300 digits"
    return text if len(text) <= 40 else text[:37] + "..."


def _figure(x: float) -> str:
    """``x`` as a range's end is written: a whole number with thousands separators (16,384),
    else its shortest form (0.5, 1e+18)."""
    return f"{int(x):,}" if math.isfinite(x) and x == int(x) and abs(x) < 1e15 else f"{x:g}"


def _is_bool(value: object) -> bool:
    """Whether ``value`` is a bool, Python's or NumPy's (``np.bool_``, named ``bool`` since
    NumPy 2), which :mod:`numbers` does not count as a number."""
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    return isinstance(value, bool) or numpy_bool


def _is_number(value: object, integer: bool) -> bool:
    """Whether ``value`` is an integer (``integer``) or a real number in a float's range, not
    a bool."""
    if _is_bool(value):
        return False
    if isinstance(value, numbers.Integral):  # a count past 2**63 is no count, and its digits
        return abs(int(value)) < (2**63 if integer else 1e300)  # overflow the messages
    return not integer and isinstance(value, numbers.Real)


def number(label: str, value: object, low: float, high: float = math.inf, *,
           integer: bool = False, above: bool = False) -> None:  # fmt: skip
    """Raises UserError naming ``label`` unless ``value`` is a number (an integer where
    ``integer``) with ``low <= value <= high`` (``low < value`` where ``above``). NaN fails
    every range; an infinity fails any finite ``high``, and ``high`` infinite still refuses it
    (no count or time is infinite)."""
    ok = _is_number(value, integer)
    if ok and not isinstance(value, numbers.Integral):
        ok = math.isfinite(value)
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
    """Raises UserError naming ``label`` unless ``value`` is an integer (``integer``) or a
    number in a float's range (never a bool); its range is left to the checks that name the
    option (NaN passes here)."""
    if not _is_number(value, integer):
        what = "an integer below 2**63" if integer else "a number below 1e300"
        raise UserError(f"{label} {_shown(value)}: must be {what}")


def flag(label: str, value: object) -> None:
    """Raises UserError naming ``label`` unless ``value`` is a bool (Python's or NumPy's)."""
    if not _is_bool(value):
        raise UserError(f"{label} {_shown(value)}: must be True or False")


def choice(label: str, value: object, choices: Iterable[object]) -> None:
    """Raises UserError naming ``label`` unless ``value`` is one of ``choices`` (strings)."""
    choices = tuple(choices)
    if not (isinstance(value, str) and value in choices):
        raise UserError(f"{label} {_shown(value)}: must be one of "
                        f"{', '.join(map(repr, choices))}")  # fmt: skip


def instance(label: str, value: object, cls: type, none: bool = False) -> None:
    """Raises UserError naming ``label`` unless ``value`` is a ``cls`` (or None, where
    ``none``)."""
    if not (isinstance(value, cls) or (none and value is None)):
        raise UserError(f"{label} {_shown(value)}: must be a {cls.__name__}"
                        f"{' or None' if none else ''}")  # fmt: skip
