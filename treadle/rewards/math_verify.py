"""Math answer checking with Hugging Face's ``math-verify``: exact values compare exactly.

Why a layer on top: math-verify 0.9's numeric checks have absolute tolerances, so it rewards
wrong answers of the right form. ``grader.sympy_numeric_eq`` accepts a pair when
``(gold - answer).evalf(n=15, chop=True)`` is 0, and ``chop`` zeroes anything under about 1e-15:
``\\frac{1}{2004!}`` "equals" ``\\frac{1}{2006!}`` and ``\\sqrt{2}`` equals ``\\sqrt{2}+10^{-20}``.
It compares decimals by rounding both to 6 decimal places, so 0.0000001 equals 0.0000002 (its
issue #21). Its knobs (``float_rounding``, ``numeric_precision``) only move these absolute
thresholds; they cannot make them relative or remove them. The policy, on math-verify's parsed
answers:

* **Exact values** (no decimal literal: integers, fractions, factorials, powers, binomials,
  radicals, pi, e, logs) are equal only when the exact difference is zero, proved by
  ``sympy.simplify(gold - answer)``: ``2^{10}`` = 1024, ``\\binom{5}{2}`` = 10, ``3!`` = 6,
  ``\\sqrt{12}`` = ``2\\sqrt{3}``; but ``2^{64}`` != ``2^{64}+1`` and 1/2004! != 1/2006!.
  Floats never decide equality: a 30-digit evaluation (``evalf(strict=True)``, so its digits are
  right) only rules out values that already differ there, which also keeps ``10^{10^{10}}`` from
  being expanded. An equality sympy cannot prove within the timeout scores 0.
* **Every decimal is the exact value it writes** (``100.0004`` is 250001/2500,
  ``1.5\\times10^{3}`` is 1500, ``0.3000000000000000`` is 3/10). A decimal against a value
  that a decimal writes exactly (every integer, 1/4, 1/8: a rational whose denominator is
  ``2^a 5^b``) must equal it: ``100.0004`` != 100, ``0.250001`` != 1/4, ``1.5\\times10^{3}`` =
  1500.
* **A decimal against an exact value no decimal writes** (1/3, pi, sqrt 2) is equal within
  relative 5e-6 of the exact value, so a decimal correctly rounded to six significant digits
  always passes (0.333333 for 1/3, 0.666667 for 2/3, 3.14159 for pi), while 0.3333 (1e-4 off) or
  0.33333 (1e-5 off) for 1/3 do not. Relative 5e-6 is up to five units in the sixth digit for a
  leading 1 and half a unit for a leading 9, so 0.333334 passes for 1/3 too. 5e-6 is the
  smallest tolerance that passes every such rounding (1.00001 for 1.000005 is 5e-6 off). Six
  digits is math-verify's own default (``float_rounding=6``, six decimal *places*) made
  relative, so it means the same at 10^{-30} as at 10^{30}: 0.00199 no longer passes for 2/1005
  (three digits; math-verify took it), and 904.779 now passes for 288 pi (math-verify wanted
  904.778684). The tolerance is on the value, not on the digits written: 3.1416 for pi is 2.3e-6
  off and passes.
* **Two decimal literals** are two exact decimals: 18.9 = 18.90, 3.14159 != 3.14158. Neither
  approximates the other, so there is nothing to be tolerant about.
* **Everything else** (tuples, sets, intervals, matrices, equations, text, percentages such as
  ``9\\%`` = 9, expressions with variables) must match under math-verify's own comparison, run
  with ``numeric_precision`` raised to 1,000 digits when neither side has a decimal, so that its
  ``evalf`` only zeroes differences under ~1e-1000 (``x^2+1`` != ``x^2+1+10^{-20}``). The numbers
  in two tuples, intervals or matrices must then also be equal place by place, and those of two
  sets one to one, and the right sides of ``x = ...``, under the rules above:
  ``(1, \\frac{1}{2004!})`` != ``(1, \\frac{1}{2006!})``, ``(0.0000001, 1)`` != ``(0.0000002, 1)``,
  ``x = \\frac{1}{2004!}`` != ``\\frac{1}{2006!}``. The known limit: in other equations and in
  expressions with variables, exact differences under 1e-1000 and decimals past the sixth
  decimal place still vanish (``y = x + 10^{-2000}`` matches ``y = x``).

The near-miss audit that holds this policy to account is ``tests/rewards/near_misses.json``.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
from collections.abc import Callable

import math_verify
import sympy
from math_verify.errors import TimeoutException
from math_verify.utils import timeout
from sympy.core.evalf import PrecisionExhausted

from treadle.core.types import Task
from treadle.rewards.base import Score
from treadle.rewards.extract import Extraction, extract_answer, parse_extraction

logger = logging.getLogger(__name__)

# math-verify's own per-step timeout, in whole seconds (it uses signal.alarm). A step that runs
# out counts as a wrong answer inside math-verify; the pool's timeout is the outer guard.
_MATH_VERIFY_TIMEOUT_S = 5
# An unescaped $, \( , \[ or \boxed: the text already marks its math (a dollar sign \$5 does not).
_DELIMITED = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed")
# A decimal against an exact value: half a unit in the sixth significant digit (module docstring).
_DECIMAL_RTOL = sympy.Rational(5, 10**6)
# Digits for the evalf calls below: far more than either tolerance needs (6 and 20 digits).
_EVAL_DIGITS = 30
# Two exact values whose 30-digit values (each right to 30 digits: evalf(strict=True)) differ by
# more than this, relatively, are different; anything closer is left to the exact check.
_DIFFERENT_RTOL = sympy.Rational(1, 10**20)
# math-verify's numeric_precision: its default 15 with a decimal present; 1,000 digits otherwise,
# so its evalf(chop=True) zeroes only exact differences under ~1e-1000. More digits cost more
# than they catch: arctan(1) - pi/4 takes 10 ms at 1,000 digits, 0.65 s at 10,000.
_DEFAULT_DIGITS = 15
_EXACT_DIGITS = 1_000
# Not finite or a percentage (latex2sympy writes 9\% as 9*UnevaluatedExpr(1/100)): math-verify's.
_NOT_PLAIN = (sympy.UnevaluatedExpr, sympy.oo, -sympy.oo, sympy.zoo, sympy.nan)


class MathVerifyReward:
    """Reward 1.0 when the completion's answer equals ``task.answer``, else 0.0.

    The answer is extracted with ``extract`` (see :class:`~treadle.rewards.extract.Extraction`);
    a completion without one gets 0.0. Both sides are parsed by math-verify. Numbers compare
    exactly, except a decimal against an exact value (within relative 5e-6); everything else
    goes through math-verify's ``verify``, and the numbers inside tuples, sets, intervals and
    matrices then compare as numbers do (the policy and its reasons: the module docstring).
    Gold goes first (math-verify is not symmetric). ``task.answer`` is a bare answer: a number
    (GSM8K, already cut to what follows ``####``) or LaTeX without ``$`` (MATH).

    Args:
        extract: ``"answer_tag"`` (default), ``"boxed"``, ``"last_number"`` or ``"full"``.

    Raises:
        UserError: ``extract`` is not a valid option (at construction).
        ValueError: from :meth:`score` when ``task.answer`` is empty or math-verify cannot parse
            it (a data bug, so it surfaces instead of silently scoring every sample 0).
    """

    name = "math_verify"

    def __init__(self, extract: str = "answer_tag") -> None:
        self.extraction = parse_extraction(extract)

    def score(self, task: Task, response: str) -> Score:
        """Score ``response`` against ``task.answer``; see the class docstring."""
        answer = extract_answer(response, self.extraction)
        if answer is None:
            return Score(reward=0.0, correct=False)
        gold = _parse(task.answer, isolated=True)
        if not gold:
            raise ValueError(f"task {task.task_id}: math-verify cannot parse gold {task.answer!r}")
        target = _parse(answer, isolated=self.extraction is not Extraction.FULL)
        correct = any(_match(g, t) for g, t in itertools.product(gold, target))
        return Score(reward=1.0 if correct else 0.0, correct=correct)


def _parse(text: str, isolated: bool) -> list[object]:
    """Parse with math-verify; ``isolated`` means ``text`` is just the answer, not prose.

    An isolated answer without math delimiters is wrapped in ``$...$``: math-verify only reads
    bare text as a plain expression, so ``2\\sqrt{3}`` would parse as ``2`` and ``\\sqrt{51}``
    as nothing at all.
    """
    if isolated and not _DELIMITED.search(text):
        text = f"${text}$"
    return math_verify.parse(text, parsing_timeout=_timeout_s())


def _match(gold: object, target: object) -> bool:
    """One parsed form of the gold against one of the answer (``parse`` returns a sympy object
    and the matched string; ``verify`` likewise tries every pair)."""
    if _is_number(gold) and _is_number(target):
        return _within_timeout(_numbers_equal, gold, target)
    exact = not (_has_decimal(gold) or _has_decimal(target))
    return math_verify.verify(
        gold,
        target,
        numeric_precision=_EXACT_DIGITS if exact else _DEFAULT_DIGITS,
        timeout_seconds=_timeout_s(),
    ) and _within_timeout(_elements_agree, gold, target)


def _elements_agree(gold: object, target: object) -> bool:
    """Whether the numbers that sit at the same place in two tuples, intervals or matrices (or
    anywhere in two sets) are equal under the number policy; math-verify, which has just matched
    the two structures, compares their elements with its absolute tolerances. True for anything
    else, which is math-verify's alone."""
    gold, target = _assigned_value(gold), _assigned_value(target)
    if _is_number(gold) and _is_number(target):
        return _numbers_equal(gold, target)
    if isinstance(gold, sympy.FiniteSet) and isinstance(target, sympy.FiniteSet):
        # A set has no order: each number of the gold needs an equal number in the answer.
        numbers = [t for t in target.args if _is_number(t)]
        return all(any(_numbers_equal(g, t) for t in numbers) for g in gold.args if _is_number(g))
    return all(_elements_agree(g, t) for g, t in _aligned(gold, target))


def _aligned(gold: object, target: object) -> list[tuple[object, object]]:
    """The element pairs of two ordered structures of the same type and shape, else none."""
    if isinstance(gold, sympy.Tuple) and isinstance(target, sympy.Tuple):
        return list(zip(gold.args, target.args, strict=False)) if len(gold) == len(target) else []
    if isinstance(gold, sympy.Interval) and isinstance(target, sympy.Interval):
        return [(gold.start, target.start), (gold.end, target.end)]
    if isinstance(gold, sympy.MatrixBase) and isinstance(target, sympy.MatrixBase):
        return list(zip(gold, target, strict=False)) if gold.shape == target.shape else []
    return []


def _numbers_equal(gold: sympy.Expr, target: sympy.Expr) -> bool:
    """The number policy of the module docstring: each decimal is taken as the exact value it
    writes; two values that are then both finite decimals (integers included) compare exactly,
    a decimal against a value without a finite decimal expansion (1/3, pi) within relative
    5e-6, and two exact values exactly."""
    if gold == target:
        return True
    decimal = _has_decimal(gold) or _has_decimal(target)
    gold, target = _as_written(gold), _as_written(target)
    if decimal and not (_finite_decimal(gold) and _finite_decimal(target)):
        return _relatively_close(gold, target, _DECIMAL_RTOL)
    if not _relatively_close(gold, target, _DIFFERENT_RTOL, strict=True):
        return False  # cheap and certain: 30-digit values that differ early
    difference = sympy.simplify(gold - target)
    if difference.is_zero is not None:
        return bool(difference.is_zero)
    # simplify could not decide; equals() tries harder (minimal polynomials) and may return None.
    return difference.equals(0) is True


def _as_written(expr: sympy.Expr) -> sympy.Expr:
    """``expr`` with each decimal literal replaced by the rational it writes (``100.0004`` is
    250001/2500, ``1.5\\times10^{3}`` is 1500, ``0.3000000000000000`` is 3/10): sympy prints
    a Float with the digits it was parsed with, which give back the literal."""
    return expr.xreplace({f: sympy.Rational(str(f)) for f in expr.atoms(sympy.Float)})


def _finite_decimal(expr: sympy.Expr) -> bool:
    """Whether ``expr`` is a rational whose reduced denominator is ``2^a 5^b`` (every integer,
    1/4, 0.125): a value a decimal can write exactly, so a decimal answer must equal it."""
    if not expr.is_Rational:
        return False
    q = int(expr.q)
    for p in (2, 5):
        while q % p == 0:
            q //= p
    return q == 1


def _relatively_close(
    gold: sympy.Expr, target: sympy.Expr, rtol: sympy.Rational, strict: bool = False
) -> bool:
    """``|gold - target| <= rtol * max(|gold|, |target|)``, from 30-digit values.

    With ``strict``, a value sympy cannot evaluate to 30 correct digits (cancellation beyond its
    100-digit limit, or an integer over Python's 4,300-digit printing limit in sympy's message)
    counts as close: the caller then decides exactly. Without it, such a value is not close.
    """
    try:
        values = [x.evalf(_EVAL_DIGITS, strict=strict) for x in (gold, target, gold - target)]
    except PrecisionExhausted:
        return True
    except ValueError:  # sympy printing a huge integer into its PrecisionExhausted message
        return strict
    a, b, difference = values
    return bool(abs(difference) <= rtol * max(abs(a), abs(b)))


def _within_timeout(
    compare: Callable[[object, object], bool], gold: object, target: object
) -> bool:
    """``compare(gold, target)`` under math-verify's per-step timeout and its error rule: a
    step that times out or raises scores 0, as a failed step inside ``verify`` does."""
    try:
        return timeout(timeout_seconds=_timeout_s())(compare)(gold, target)
    except TimeoutException:
        logger.warning("math answer comparison timed out after %s s", _timeout_s())
    except Exception:  # sympy raises many types (TypeError, RecursionError, ...) on odd input
        logger.debug("math answer comparison failed", exc_info=True)
    return False


def _assigned_value(expr: object) -> object:
    """``5`` for ``x = 5``: math-verify compares ``x = 5`` with ``5`` (and ``x = 6`` with
    ``x = 5``) through the right sides, so the number policy checks those."""
    if isinstance(expr, sympy.Eq) and isinstance(expr.lhs, sympy.Symbol):
        return expr.rhs
    return expr


def _is_number(expr: object) -> bool:
    """A finite number without a percent sign: what the number policy covers."""
    return isinstance(expr, sympy.Expr) and bool(expr.is_number) and not expr.has(*_NOT_PLAIN)


def _has_decimal(expr: object) -> bool:
    """Whether ``expr`` contains a decimal literal (latex2sympy parses 3.14 as a sympy Float)."""
    return isinstance(expr, sympy.Basic | sympy.MatrixBase) and expr.has(sympy.Float)


def _timeout_s() -> int | None:
    # signal.alarm only works on the main thread; elsewhere (workers=0 called from a thread)
    # math-verify must run without its own timeout or it raises.
    if threading.current_thread() is threading.main_thread():
        return _MATH_VERIFY_TIMEOUT_S
    return None
