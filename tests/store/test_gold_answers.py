"""Gold answers taken out of a solution field (``answer_extract``), bad rows skipped and counted
(``skip_bad_rows``), and every row of a file read unsplit (``load_gold_rows``)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from treadle.config import DataConfig, MixConfig, load_config
from treadle.core.errors import UserError
from treadle.store.data import load_dataset, load_gold_rows

# Minerva-math in its public form: the answer only in the last \boxed{} of the solution.
MINERVA = [
    {"problem": "Half of one?", "solution": "Divide: $\\boxed{\\frac{1}{2}}$."},
    {"problem": "Two tries?", "solution": "First $\\boxed{3}$, but no: $\\boxed{4}$."},
    {"problem": "Spaced?", "solution": "So \\boxed {\\sqrt{2}} m."},
    {"problem": "Framed?", "solution": "\\fbox{1,000}"},  # thousands separator dropped
]


def write_jsonl(path: Path, rows: list[dict], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def test_boxed_extractor_reads_a_minerva_like_solution_field(tmp_path):
    path = write_jsonl(tmp_path / "minerva.jsonl", MINERVA)
    cfg = DataConfig(source="jsonl", path=str(path), question_field="problem",
                     answer_field="solution", answer_extract="boxed", eval_size=1)  # fmt: skip
    data = load_dataset(cfg)
    assert [t.answer for t in data.train] == ["\\frac{1}{2}", "4", "\\sqrt{2}"]
    assert [t.answer for t in data.held_out] == ["1000"]
    assert data.skipped == ()


@pytest.mark.parametrize(
    ("extract", "field", "expected"),
    [
        ("gsm8k", "Add them: 3 + 4 = <<3+4=7>>7\n#### 7", "7"),
        ("answer_is", "3 + 4 = 7. The answer is 7.", "7"),
    ],
)
def test_gsm8k_and_answer_is_extractors(tmp_path, extract, field, expected):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": field}] * 2)
    data = load_dataset(DataConfig(source="jsonl", path=str(path), answer_extract=extract,
                                   eval_size=1))  # fmt: skip
    assert data.train[0].answer == expected


def test_without_skip_a_bad_row_names_file_line_and_the_switch(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [*MINERVA[:2], {"problem": "p", "solution": "none"}])
    cfg = DataConfig(source="jsonl", path=str(path), question_field="problem",
                     answer_field="solution", answer_extract="boxed", eval_size=1)  # fmt: skip
    with pytest.raises(UserError) as e:
        load_dataset(cfg)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: data.answer_extract=boxed finds no answer")
    assert msg.endswith("set data.skip_bad_rows=true to skip such rows")


def test_one_malformed_row_is_skipped_and_counted(tmp_path, caplog):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(4)]
    path = write_jsonl(tmp_path / "d.jsonl", rows[:2], tail='{"question": "q", answer: 2}\n')
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[2:])
    cfg = DataConfig(source="jsonl", path=str(path), eval_size=1, skip_bad_rows=True)
    with caplog.at_level(logging.WARNING, logger="treadle.store.data"):
        data = load_dataset(cfg)
    # 5 lines, line 3 not JSON: 4 rows load, 3 train and 1 held out; exactly 1 skipped.
    assert len(data.skipped) == 1 and data.skipped[0].startswith(f"{path}:3: malformed JSON")
    assert [t.answer for t in (*data.train, *data.held_out)] == ["0", "1", "2", "3"]
    assert "skipped 1 bad rows (data.skip_bad_rows=true)" in caplog.text
    # Without the switch the same file stops the load at that line.
    with pytest.raises(UserError, match=re.escape(f"{path}:3: malformed JSON")):
        load_dataset(DataConfig(source="jsonl", path=str(path), eval_size=1))


def test_each_kind_of_bad_row_is_skipped(tmp_path):
    rows = [
        {"question": "ok", "answer": "#### 1"},
        {"question": "no answer field"},  # missing field
        {"question": "no marker", "answer": "just prose"},  # the extractor finds nothing
        {"question": "empty", "answer": "#### "},  # the extractor finds an empty answer
        {"question": "ok too", "answer": "#### 2"},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows, tail="[1, 2]\n")  # not a JSON object
    cfg = DataConfig(source="jsonl", path=str(path), answer_extract="gsm8k", eval_size=1,
                     skip_bad_rows=True)  # fmt: skip
    data = load_dataset(cfg)
    assert [t.answer for t in data.train] == ["1"] and [t.answer for t in data.held_out] == ["2"]
    # Lines 2, 3, 4 and 6 are bad (line 6 is found first, when the file is parsed).
    why = dict(s.split(": ", 1) for s in data.skipped)
    assert sorted(why) == [f"{path}:{n}" for n in (2, 3, 4, 6)]
    assert why[f"{path}:2"].startswith("no field 'answer' (data.answer_field)")
    assert why[f"{path}:3"].startswith("data.answer_extract=gsm8k finds no answer")
    assert why[f"{path}:4"].startswith("data.answer_extract=gsm8k takes an empty answer")
    assert why[f"{path}:6"] == "expected a JSON object per line"


def test_a_mixed_source_names_its_own_key_and_its_skips_are_kept(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"question": "q", "answer": "1"}] * 3)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "1"}] * 3,
                      tail="not json\n")  # fmt: skip
    mix = dict(source="jsonl", path=str(bad), domain="b", weight=1.0, eval_size=1)
    cfg = DataConfig(source="jsonl", path=str(good), eval_size=1, mix=[MixConfig(**mix)])
    with pytest.raises(UserError, match=re.escape("set data.mix[0].skip_bad_rows=true")):
        load_dataset(cfg)
    cfg.mix = [MixConfig(**mix, skip_bad_rows=True)]
    assert load_dataset(cfg).skipped == (f"{bad}:4: malformed JSON line (Expecting value)",)


def test_gold_rows_are_every_row_of_a_file_smaller_than_the_held_out_split(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", MINERVA[:2])
    cfg = DataConfig(source="jsonl", path=str(path), question_field="problem",
                     answer_field="solution", answer_extract="boxed", eval_size=100)  # fmt: skip
    with pytest.raises(
        UserError, match=re.escape("2 usable rows, need more than data.eval_size=100")
    ):
        load_dataset(cfg)  # training needs a split...
    rows = load_gold_rows(cfg)  # ...checking the golds does not
    assert [t.answer for t in rows.tasks] == ["\\frac{1}{2}", "4"]
    assert rows.raw_answers == (MINERVA[0]["solution"], MINERVA[1]["solution"])


def test_answer_pattern_and_answer_extract_together_are_refused():
    with pytest.raises(UserError, match=r"data.answer_extract=boxed: data.answer_pattern is set"):
        load_config(None, ["data.answer_extract=boxed", "data.answer_pattern=(.+)"])


SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
MATH500 = SHARED / "math500" / "test.jsonl"


@pytest.mark.skipif(not MATH500.exists(), reason=f"needs MATH-500 at {MATH500}")
@pytest.mark.parametrize(
    ("how", "equal"),
    [
        # Measured on all 500 rows: the golds equal to the file's own `answer` field (one
        # row's "58,500" is read as 58500, as every gold with thousands separators is).
        ({"answer_pattern": r"\\boxed\{(.*)\}"}, 484),  # greedy: runs on to the line's last }
        ({"answer_pattern": r"\\boxed\{(.*?)\}"}, 397),  # lazy: stops at the first }
        ({"answer_extract": "boxed"}, 500),
    ],
    ids=["greedy-regex", "lazy-regex", "boxed"],
)
def test_math500_solution_field(how, equal):
    cfg = DataConfig(source="jsonl", path=str(MATH500), question_field="problem",
                     answer_field="solution", eval_size=1, **how)  # fmt: skip
    rows = load_gold_rows(cfg)
    answers = [json.loads(line)["answer"] for line in MATH500.read_text().splitlines()]
    assert len(rows.tasks) == 500
    gold = [a.strip().replace("58,500", "58500") for a in answers]
    same = [t.answer == a for t, a in zip(rows.tasks, gold, strict=True)]
    assert sum(same) == equal
