"""Reading a reward function's constructor params: numbers, bools, strings and lists from YAML
(``params: {timeout_s: 10, strict: true}``), and, as older recipes wrote them, numbers as
strings (``timeout_s: "10"``)."""

from __future__ import annotations

from treadle.config import ParamValue
from treadle.core.errors import UserError


def float_param(value: ParamValue, what: str) -> float:
    """A number param: an int or float from YAML, or a numeric string (older recipes wrote
    every param as a string; YAML 1.1 also reads ``1e-5`` as one).

    Raises:
        UserError: not a number (a bool, a list, a non-numeric string), naming ``what``.
    """
    return _number(value, what, float, "a number")


def int_param(value: ParamValue, what: str) -> int:
    """An integer param: an int from YAML, or an integer string (older recipes).

    Raises:
        UserError: not an integer (a float such as 2.5, a bool, a list, other text).
    """
    return _number(value, what, int, "an integer")


def _number(value: ParamValue, what: str, kind: type, named: str) -> int | float:
    """``value`` as ``kind`` (int or float): a YAML number of that kind (an int for a float
    too) or a string that parses as one; a bool is not a number."""
    if isinstance(value, int | kind) and not isinstance(value, bool):
        return kind(value)
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            pass
    raise UserError(f"{what} must be {named}, got {value!r}")


def str_param(value: ParamValue, what: str) -> str:
    """A text param.

    Raises:
        UserError: not a string (a number, bool or list), naming ``what``.
    """
    if not isinstance(value, str):
        raise UserError(f"{what} must be a string, got {value!r}")
    return value
