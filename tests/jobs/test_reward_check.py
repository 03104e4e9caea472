"""``treadle reward-check``: gold answers, written as a model would write them, against the
recipe's own graders, and the look of golds taken out of a longer field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treadle.cli import main
from treadle.config import load_config
from treadle.core.types import Task
from treadle.jobs.reward_check import check_gold, gold_looks
from treadle.store.data import GoldRows

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "default.yaml"
SMALL = ["data.size=40", "data.eval_size=10", "reward.workers=0"]


def test_default_recipe_graders_accept_every_gold_answer(capsys):
    assert main(["reward-check", str(RECIPE), *SMALL]) == 0
    out = capsys.readouterr().out
    assert "0 of 50 gold answers fail: 0 rejected by their own grader, 0 look cut" in out
    assert "sample" not in out  # reasoning-gym golds are not taken out of a longer field


def test_a_grader_that_cannot_read_the_gold_format_is_reported(capsys):
    # The demonstrations write <answer>N</answer>; a math grader told to read \boxed{} finds no
    # answer in any of them: every gold fails, and the command exits 1.
    broken = [*SMALL, "reward.functions=[{name: math_verify, params: {extract: boxed}}]"]
    result = check_gold(load_config(RECIPE, broken))
    assert result.total == 50 and len(result.failures) == 50
    assert (result.rejected, result.suspect) == (50, 0)
    assert result.failures[0].reward == 0.0
    assert result.failures[0].reasons == ("rejected by the graders",)
    assert main(["reward-check", str(RECIPE), *broken]) == 1
    out = capsys.readouterr().out
    assert "50 of 50 gold answers fail: 50 rejected" in out and "... and 30 more" in out


def test_bad_recipe_input_exits_2(capsys):
    assert main(["reward-check", str(RECIPE), "reward.functions=[{name: nope}]"]) == 2
    assert "nope" in capsys.readouterr().err


# Minerva-math in its public form: no answer field, the answer in the solution's last \boxed{}.
MINERVA = [
    {"problem": "Half?", "solution": "Divide: $\\boxed{\\frac{1}{2}}$."},
    {"problem": "Length?", "solution": "It is $\\boxed{3}$ cm, not $\\text{m}$."},
    {"problem": "Root?", "solution": "So $x = \\boxed{\\sqrt{2}}$."},
    {"problem": "Sum?", "solution": "First $\\boxed{5}$; no, $\\boxed{6}$."},
]


def minerva_overrides(path: Path, how: str) -> list[str]:
    """The default recipe on a Minerva-like file: boxed demonstrations, a boxed math grader."""
    return [
        "data.source=jsonl", f"data.path={path}", "data.question_field=problem",
        "data.answer_field=solution", how, "data.reasoning=none",
        "data.answer_template=\\boxed{{{answer}}}",  # str.format: {{ is a literal brace
        "reward.functions=[{name: math_verify, params: {extract: boxed}}]", "reward.workers=0",
    ]  # fmt: skip


@pytest.fixture
def minerva(tmp_path: Path) -> Path:
    path = tmp_path / "minerva.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MINERVA))
    return path


def test_the_boxed_extractor_passes_a_file_smaller_than_the_held_out_split(minerva, capsys):
    # 4 rows, data.eval_size 200 (the default recipe's): every row is checked all the same.
    overrides = minerva_overrides(minerva, "data.answer_extract=boxed")
    result = check_gold(load_config(RECIPE, overrides))
    assert (result.total, len(result.failures)) == (4, 0)
    assert [s.answer for s in result.samples] == ["\\frac{1}{2}", "3", "\\sqrt{2}", "6"]
    assert main(["reward-check", str(RECIPE), *overrides]) == 0
    out = capsys.readouterr().out
    assert "0 of 4 gold answers fail" in out and "gold taken out" in out


@pytest.mark.parametrize(
    ("pattern", "cut", "rejected"),
    [
        # Greedy: row 0 "\frac{1}{2}" is right by luck (the line's last } closes the box); row 1
        # runs on to "3}$ cm, not $\text{m"; row 2 is right; row 3 takes "5}$; no, $\boxed{6".
        # Both are rejected here; on MATH-500 the grader rejects only 5 of greedy's 16 cut golds
        # (test_math500_reward_check): the look of the gold is what flags them all.
        (
            r"\\boxed\{(.*)\}",
            {"minerva/1": "3}$ cm, not $\\text{m", "minerva/3": "5}$; no, $\\boxed{6"},
            2,
        ),
        # Lazy: stops at the first }: "\frac{1" and "\sqrt{2", which their grader rejects.
        (r"\\boxed\{(.*?)\}", {"minerva/0": "\\frac{1", "minerva/2": "\\sqrt{2"}, 2),
    ],
    ids=["greedy", "lazy"],
)
def test_a_brace_regex_is_flagged_not_0_fail(minerva, capsys, pattern, cut, rejected):
    overrides = minerva_overrides(minerva, f"data.answer_pattern={pattern}")
    result = check_gold(load_config(RECIPE, overrides))
    assert {f.task_id: f.answer for f in result.failures} == cut
    assert all("unbalanced braces" in f.reasons for f in result.failures)
    assert (result.rejected, result.suspect) == (rejected, 2)
    assert main(["reward-check", str(RECIPE), *overrides]) == 1
    out = capsys.readouterr().out
    assert f"2 of 4 gold answers fail: {rejected} rejected" in out
    assert "data.answer_extract=boxed can" in out


def test_skipped_rows_are_reported(minerva, capsys):
    with minerva.open("a") as f:
        f.write('{"problem": "no box", "solution": "prose only"}\n')
    overrides = minerva_overrides(minerva, "data.answer_extract=boxed")
    assert main(["reward-check", str(RECIPE), *overrides]) == 2  # without the switch: one line
    assert f"{minerva}:5: data.answer_extract=boxed finds no answer" in capsys.readouterr().err
    assert main(["reward-check", str(RECIPE), *overrides, "data.skip_bad_rows=true"]) == 0
    out = capsys.readouterr().out
    assert "1 bad rows skipped (data.skip_bad_rows)" in out and "0 of 4 gold answers" in out


def rows(golds: list[str], raw: str = "a longer field") -> GoldRows:
    tasks = tuple(Task(f"t/{i}", (), answer=g, domain="math") for i, g in enumerate(golds))
    return GoldRows(tasks, (raw,) * len(golds))


@pytest.mark.parametrize(
    ("gold", "looks"),
    [
        ("\\frac{1}{2}", ()),
        ("[0, 1)", ()),  # a half-open interval: either bracket closes either
        ("\\{1, 2\\}", ()),  # escaped braces are literals
        ("(-\\infty, 2] \\cup [3, \\infty)", ()),
        ("\\frac{1", ("unbalanced braces",)),
        ("3} \\pmod{7", ("unbalanced braces",)),  # closes below depth 0, then opens again
        ("\\left( 3, \\frac{\\pi", ("unbalanced braces", "unbalanced brackets or parentheses")),
        ("f(x", ("unbalanced brackets or parentheses",)),
        ("  ", ("empty",)),
    ],
)
def test_gold_looks_of_one_gold(gold, looks):
    assert gold_looks(rows([gold])) == [looks]


def test_an_unbalanced_gold_is_only_suspect_when_taken_out_of_a_longer_field():
    # The whole answer field, unchanged (raw == gold): what the file holds, not a cut.
    assert gold_looks(rows(["f(x"], raw="f(x")) == [()]
    assert gold_looks(rows([""], raw="")) == [("empty",)]  # empty is always suspect


@pytest.mark.parametrize(
    ("golds", "flagged"),
    [
        (["7"] * 8 + ["1", "2"], 8),  # 8 of 10 = 80% one value: each of the 8 flagged
        (["7"] * 7 + ["1", "2", "3"], 0),  # 7 of 10 = 70% < 80%
        (["7"] * 9, 0),  # 9 rows, fewer than 10: too few to judge
    ],
)
def test_one_value_across_most_golds(golds, flagged):
    same = [w for w in gold_looks(rows(golds)) if w]
    assert len(same) == flagged
    assert all(w == (f"same value as {flagged} of {len(golds)} golds",) for w in same)


SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
MATH500 = SHARED / "math500" / "test.jsonl"


@pytest.mark.skipif(not MATH500.exists(), reason=f"needs MATH-500 at {MATH500}")
@pytest.mark.parametrize(
    ("how", "failed", "rejected"),
    [
        # Measured on all 500 rows (the loader test counts 484 and 397 golds right): greedy cuts
        # 16, of which the boxed grader rejects only 5 once written as \boxed{gold}; lazy cuts
        # 103, all rejected. The look of the gold flags all of them.
        (r"data.answer_pattern=\\boxed\{(.*)\}", 16, 5),
        (r"data.answer_pattern=\\boxed\{(.*?)\}", 103, 103),
        ("data.answer_extract=boxed", 0, 0),
    ],
    ids=["greedy-regex", "lazy-regex", "boxed"],
)
def test_math500_reward_check(how, failed, rejected):
    result = check_gold(load_config(RECIPE, minerva_overrides(MATH500, how)))
    assert result.total == 500
    assert (len(result.failures), result.rejected, result.suspect) == (failed, rejected, failed)


@pytest.mark.parametrize(
    "text, skip, said",
    [
        ("", False, "gives no task to check; is the file empty?"),
        ('{"q": 1}\n{"q": 2}\n', True, "2 bad rows skipped, the first: "),
    ],
)
def test_nothing_to_check_is_an_error_not_0_of_0_fail(tmp_path, capsys, text, skip, said):
    # An empty file, or one whose every row is skipped, checks 0 golds: "0 of 0 fail", exit 0,
    # read as a pass, so it is refused in one line (exit 2).
    path = tmp_path / "rows.jsonl"
    path.write_text(text)
    overrides = [
        "data.source=jsonl", f"data.path={path}", f"data.skip_bad_rows={str(skip).lower()}",
        "data.reasoning=none", "reward.functions=[{name: math_verify}]", "reward.workers=0",
    ]  # fmt: skip
    assert main(["reward-check", str(RECIPE), *overrides]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after the skipped rows' logged warning
    assert last.startswith("treadle: error: treadle reward-check: data (") and said in last
