"""Tests for treadle.store.data: file and reasoning-gym sources, their errors, the task sampler."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import reasoning_gym

from treadle.config import DataConfig
from treadle.core.errors import UserError
from treadle.core.types import Message, Task
from treadle.store.data import (
    DataPosition,
    TaskSampler,
    chain_steps,
    load_all_tasks,
    load_dataset,
    render_demonstration,
)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def jsonl_cfg(path: Path, **kw) -> DataConfig:
    return DataConfig(source="jsonl", path=str(path), **{"eval_size": 1, **kw})


def test_jsonl_with_custom_columns_and_system_prompt(tmp_path):
    rows = [{"prompt": f"what is {i}+1?", "solution": i + 1, "extra": "x"} for i in range(4)]
    path = write_jsonl(tmp_path / "arith.jsonl", rows)
    data = load_dataset(
        jsonl_cfg(
            path,
            question_field="prompt",
            answer_field="solution",
            system_prompt="Be brief.",
            domain="arith",
        )
    )
    # 4 rows, eval_size 1: the last row is held out, the first 3 train, in file order.
    assert [t.task_id for t in data.train] == ["arith/0", "arith/1", "arith/2"]
    assert [t.task_id for t in data.held_out] == ["arith/3"]
    first = data.train[0]
    assert first.messages == (Message("system", "Be brief."), Message("user", "what is 0+1?"))
    assert first.answer == "1"  # the int column is read as the string "1"
    assert first.domain == "arith"
    assert first.reasoning == ""  # files carry no worked steps
    assert data.held_out[0].answer == "4"


def test_gsm8k_answer_pattern_extracts_and_strips_thousands_separators(tmp_path):
    rows = [
        {"question": "q0", "answer": "He has 400 + 600 = <<400+600=1000>>1000.\n#### 1,000"},
        {"question": "q1", "answer": "Half of 10 is 5.\n####5"},
        {"question": "q2", "answer": "#### -12"},
    ]
    path = write_jsonl(tmp_path / "gsm.jsonl", rows)
    data = load_dataset(jsonl_cfg(path, answer_pattern=r"####\s*(.+)$"))
    assert [t.answer for t in data.train] == ["1000", "5"]
    assert data.held_out[0].answer == "-12"


def test_answer_not_matching_the_pattern_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "q", "answer": "#### 1"}] * 2)
    with path.open("a") as f:
        f.write(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(UserError) as e:
        load_dataset(jsonl_cfg(path, answer_pattern=r"####\s*(.+)$"))
    assert f"{path}:3" in str(e.value) and "data.answer_pattern" in str(e.value)


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "a", "answer": "1"}\n\n{"question": "b", answer: 2}\n')
    with pytest.raises(UserError) as e:
        load_dataset(jsonl_cfg(path))
    # Line numbers count blank lines too: the bad row is physical line 3.
    assert f"{path}:3:" in str(e.value)
    assert "malformed JSON" in str(e.value)


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"question": "a", "answer": "1"}\n[1, 2]\n')
    with pytest.raises(UserError, match=re.escape(f"{path}:2: expected a JSON object")):
        load_dataset(jsonl_cfg(path))


def test_missing_field_names_the_field_and_its_config_key(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1"}, {"question": "b"}])
    with pytest.raises(UserError) as e:
        load_dataset(jsonl_cfg(path))
    msg = str(e.value)
    assert f"{path}:2" in msg and "'answer'" in msg and "data.answer_field" in msg


def test_custom_question_field_missing(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1"}] * 3)
    with pytest.raises(UserError, match=r"no field 'problem' \(data.question_field\)"):
        load_dataset(jsonl_cfg(path, question_field="problem"))


@pytest.mark.parametrize("eval_size", [0, 1])
def test_empty_file_is_a_user_error(tmp_path, eval_size):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")  # blank lines only: zero rows
    with pytest.raises(UserError, match=re.escape(str(path))):
        load_dataset(jsonl_cfg(path, eval_size=eval_size))


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="file not found"):
        load_dataset(jsonl_cfg(tmp_path / "absent.jsonl"))


def test_fewer_rows_than_the_held_out_split(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "1"}] * 2)
    with pytest.raises(
        UserError, match=re.escape("2 usable rows, need more than data.eval_size=2")
    ):
        load_dataset(jsonl_cfg(path, eval_size=2))


def test_held_out_rows_that_repeat_a_training_question_are_dropped(tmp_path):
    rows = [{"question": q, "answer": "1"} for q in ["a", "b", "c", "a", "d"]]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    data = load_dataset(jsonl_cfg(path, eval_size=2))
    # train = rows 0..2 (a, b, c); held-out candidates = rows 3, 4 (a, d); "a" was trained on.
    assert [t.messages[-1].content for t in data.train] == ["a", "b", "c"]
    assert [t.messages[-1].content for t in data.held_out] == ["d"]


def test_size_caps_training_rows_but_not_the_held_out_split(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"question": str(i), "answer": "1"} for i in range(6)]
    )
    data = load_dataset(jsonl_cfg(path, eval_size=2, size=3))
    # rows 0..3 are training candidates, capped at 3; rows 4, 5 are held out.
    assert [t.task_id for t in data.train] == ["d/0", "d/1", "d/2"]
    assert [t.task_id for t in data.held_out] == ["d/4", "d/5"]


def test_parquet_round_trip(tmp_path):
    path = tmp_path / "math.parquet"
    table = pa.table(
        {
            "problem": ["1+1", "2+2", "3+3"],
            "solution": ["Add.\n#### 2", "Add.\n#### 4", "Add.\n#### 6"],
        }
    )
    pq.write_table(table, path)
    cfg = DataConfig(
        source="parquet",
        path=str(path),
        question_field="problem",
        answer_field="solution",
        answer_pattern=r"####\s*(.+)$",
        eval_size=1,
    )
    data = load_dataset(cfg)
    assert [(t.task_id, t.messages[-1].content, t.answer) for t in data.train] == [
        ("math/0", "1+1", "2"),
        ("math/1", "2+2", "4"),
    ]
    assert [t.answer for t in data.held_out] == ["6"]


def test_parquet_missing_field_names_the_row(tmp_path):
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"question": ["a", "b"]}), path)
    with pytest.raises(UserError, match=r"row 0: no field 'answer'"):
        load_dataset(DataConfig(source="parquet", path=str(path), eval_size=1))


def test_unreadable_parquet_is_a_user_error(tmp_path):
    path = tmp_path / "m.parquet"
    path.write_text("not parquet")
    with pytest.raises(UserError, match="not a readable parquet file"):
        load_dataset(DataConfig(source="parquet", path=str(path), eval_size=1))


@pytest.mark.parametrize(
    ("content", "kw"),
    [
        (b'{"question": "caf\xe9", "answer": "1"}\n', {}),  # latin-1 byte in a jsonl file
        (b'{"question": "q", "answer": "#### 1"}\n', {"answer_pattern": "####(.+"}),
        (b'{"question": "q", "answer": "#### 1"}\n', {"answer_pattern": "####.+"}),
    ],
    ids=["non-utf8", "bad-regex", "pattern-without-group"],
)
def test_bad_data_input_is_a_user_error(tmp_path, content, kw):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content * 2)
    with pytest.raises(UserError):
        load_dataset(jsonl_cfg(path, **kw))


# chain_sum with 2 one-digit terms has 10 * 10 * 2 = 200 distinct questions, so 150 training and
# 30 held-out draws would collide often without deduplication.
SMALL_SPACE = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_reasoning_gym_held_out_never_shares_a_training_question():
    cfg = DataConfig(task="chain_sum", task_params=SMALL_SPACE, size=150, eval_size=30, seed=42)
    data = load_dataset(cfg)
    assert len(data.train) == 150 and len(data.held_out) == 30
    train_questions = {t.messages for t in data.train}
    assert not any(t.messages in train_questions for t in data.held_out)
    assert len({t.messages for t in data.held_out}) == 30  # no duplicates within held-out
    # The dedup is doing work: an independent draw from the same space overlaps training.
    fresh = reasoning_gym.create_dataset("chain_sum", size=30, seed=7, **SMALL_SPACE)
    assert any((Message("user", e["question"]),) in train_questions for e in fresh)
    # Tasks carry what the verifier and SFT need.
    t = data.train[0]
    assert t.task_id == "chain_sum/train/0" and t.domain == "math"
    assert json.loads(t.payload)["entry"]["answer"] == t.answer
    assert t.reasoning == ""  # data.reasoning defaults to "none"
    assert data.held_out[0].task_id.startswith("chain_sum/eval/")


def test_reasoning_gym_is_deterministic_per_seed():
    cfg = DataConfig(task="chain_sum", task_params=SMALL_SPACE, size=20, eval_size=5, seed=3)
    assert load_dataset(cfg) == load_dataset(cfg)
    other = load_dataset(dataclasses.replace(cfg, seed=4))
    assert [t.messages for t in other.train] != [t.messages for t in load_dataset(cfg).train]


def test_reasoning_gym_bad_task_params_is_a_user_error():
    with pytest.raises(UserError, match=re.escape("data.task chain_sum with data.task_params")):
        load_dataset(DataConfig(task="chain_sum", task_params={"min_terms": 5, "max_terms": 2}))


@pytest.mark.parametrize(
    ("expression", "steps"),
    [
        ("4 - 1 - 7", "4 - 1 = 3, 3 - 7 = -4."),  # the docstring's example
        ("12 + 30", "12 + 30 = 42."),
        ("5 - 9 + 2 - 10", "5 - 9 = -4, -4 + 2 = -2, -2 - 10 = -12."),
    ],
)
def test_chain_steps_golden(expression, steps):
    assert chain_steps(expression) == steps


@pytest.mark.parametrize("expression", ["3 * 4", "3 +", "7", "1 + 2 +"])
def test_chain_steps_rejects_other_expressions(expression):
    with pytest.raises(UserError, match="is not a \\+/- chain"):
        chain_steps(expression)


def test_reasoning_gym_chain_steps_end_at_the_gold_answer():
    cfg = DataConfig(
        task="chain_sum",
        task_params={"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 2},
        size=40,
        eval_size=5,
        reasoning="chain_steps",
    )
    data = load_dataset(cfg)
    for t in data.train + data.held_out:
        # "a op b = x, x op c = y." : the last step's result is the answer reasoning-gym computed.
        assert t.reasoning.endswith(f" = {t.answer}."), (t.reasoning, t.answer)
        expression = json.loads(t.payload)["entry"]["metadata"]["expression"]
        assert t.reasoning.count(" = ") == len(expression.split()) // 2


def test_render_demonstration_fills_reasoning_and_answer():
    t = Task(
        "t/0", (Message("user", "2 + 3 - 1 ="),), "4", "math", reasoning="2 + 3 = 5, 5 - 1 = 4."
    )
    template = "{reasoning} <answer>{answer}</answer>"
    assert render_demonstration(t, template) == "2 + 3 = 5, 5 - 1 = 4. <answer>4</answer>"
    # An explicit answer replaces the gold one (SFT noise writes wrong answers this way).
    assert render_demonstration(t, template, "6") == "2 + 3 = 5, 5 - 1 = 4. <answer>6</answer>"


def tasks(n: int) -> tuple[Task, ...]:
    return tuple(Task(f"t/{i}", (Message("user", str(i)),), str(i), "math") for i in range(n))


def ids(batch: list[Task]) -> list[str]:
    return [t.task_id for t in batch]


def test_sampler_is_deterministic_per_seed():
    a = [ids(TaskSampler(tasks(10), seed=1).next_batch(10))]
    b = [ids(TaskSampler(tasks(10), seed=1).next_batch(10))]
    c = [ids(TaskSampler(tasks(10), seed=2).next_batch(10))]
    assert a == b
    assert a != c  # 10! orders; two seeds agreeing would be a 1-in-3.6M accident


def test_sampler_epochs_are_permutations_and_reshuffle():
    sampler = TaskSampler(tasks(8), seed=0)
    epoch0, epoch1 = ids(sampler.next_batch(8)), ids(sampler.next_batch(8))
    everything = sorted(ids(list(tasks(8))))
    assert sorted(epoch0) == everything and sorted(epoch1) == everything
    assert epoch0 != epoch1
    assert sampler.position == DataPosition(epoch=1, offset=8)


def test_sampler_batch_across_an_epoch_boundary():
    sampler = TaskSampler(tasks(5), seed=0)
    first = ids(sampler.next_batch(3))
    second = ids(sampler.next_batch(4))  # 2 from epoch 0, then 2 from epoch 1
    assert sorted(first + second[:2]) == sorted(ids(list(tasks(5))))
    assert sampler.position == DataPosition(epoch=1, offset=2)


@pytest.mark.parametrize(
    ("batches_before", "position"),
    # 5 tasks, batches of 3: 3 draws -> (0, 3); 6 -> (1, 1); 15 -> (2, 5), an epoch's very end
    # (the reshuffle into epoch 3 happens lazily on the next draw).
    [(1, DataPosition(0, 3)), (2, DataPosition(1, 1)), (5, DataPosition(2, 5))],
)
def test_sampler_restored_from_position_continues_the_same_sequence(batches_before, position):
    uninterrupted = TaskSampler(tasks(5), seed=9)
    for _ in range(batches_before):
        uninterrupted.next_batch(3)
    assert uninterrupted.position == position
    saved = dataclasses.replace(uninterrupted.position)  # what a checkpoint stores
    expected = [ids(uninterrupted.next_batch(3)) for _ in range(4)]

    restored = TaskSampler(tasks(5), seed=9, position=saved)
    assert [ids(restored.next_batch(3)) for _ in range(4)] == expected
    assert restored.position == uninterrupted.position


def test_mix_draws_sources_in_proportion_to_their_weights():
    from treadle.config import DataConfig, MixConfig

    cfg = DataConfig(
        task="chain_sum",
        size=60,
        eval_size=5,
        domain="arith",
        weight=3.0,
        mix=[MixConfig(source="reasoning_gym", task="basic_arithmetic", size=20, eval_size=5,
                       domain="basic", weight=1.0)],
    )  # fmt: skip
    data = load_dataset(cfg)
    # N = 60 + 20 = 80 prompts: round(3/4 * 80) = 60 chain sums, round(1/4 * 80) = 20 basic
    domains = [t.domain for t in data.train]
    assert (domains.count("arith"), domains.count("basic")) == (60, 20)
    assert sorted({t.domain for t in data.held_out}) == ["arith", "basic"]
    assert len(data.held_out) == 10


def test_a_small_source_with_a_large_weight_is_cycled():
    from treadle.config import DataConfig, MixConfig

    cfg = DataConfig(
        size=10, eval_size=2, domain="a", weight=1.0,
        mix=[MixConfig(source="reasoning_gym", task="basic_arithmetic", size=4, eval_size=2,
                       domain="b", weight=3.0)],
    )  # fmt: skip
    data = load_dataset(cfg)
    b = [t for t in data.train if t.domain == "b"]
    # N = 14: round(3/4 * 14) = 10 (rounds half to even: 10.5 -> 10) from 4 distinct prompts
    assert len(b) == 10 and len({t.task_id for t in b}) == 4


SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.mark.skipif(not (SHARED / "mbpp").exists(), reason=f"needs {SHARED / 'mbpp'}")
def test_mbpp_as_code_tasks_whose_gold_passes_the_code_reward():
    from treadle.config import DataConfig
    from treadle.rewards.code import CodeReward

    cfg = DataConfig(source="mbpp", path=str(SHARED / "mbpp" / "sanitized-mbpp.json"),
                     domain="code", size=5, eval_size=3)  # fmt: skip
    data = load_dataset(cfg)
    assert len(data.train) == 5 and len(data.held_out) == 3
    task = data.train[0]
    assert task.domain == "code" and task.answer.startswith("```python")
    assert "Your code should pass this test" in task.messages[-1].content
    assert CodeReward().score(task, f"<answer>{task.answer}</answer>").reward == 1.0


def test_two_sources_of_one_task_get_distinct_task_ids():
    # Both sources number their prompts chain_sum/train/0, 1, ...; a task id names one prompt's
    # group of rollouts (advantages are group-relative), so the second source's are prefixed.
    from treadle.config import DataConfig, MixConfig

    cfg = DataConfig(
        task="chain_sum", size=20, eval_size=5, domain="short", weight=1.0,
        mix=[MixConfig(source="reasoning_gym", task="chain_sum", size=20, eval_size=5,
                       domain="long", weight=1.0, task_params={"min_terms": 5, "max_terms": 6})],
    )  # fmt: skip
    data = load_dataset(cfg)
    prompts: dict[str, str] = {}
    for t in (*data.train, *data.held_out):
        assert prompts.setdefault(t.task_id, t.messages[-1].content) == t.messages[-1].content
    long = [t.task_id for t in data.train if t.domain == "long"]
    assert len(long) == 20 and all(i.startswith("mix0/chain_sum/") for i in long)
    assert all(not t.task_id.startswith("mix0/") for t in data.train if t.domain == "short")


def _rows_with_a_latin1_line(tmp_path: Path) -> Path:
    # Line 2 is Latin-1 ("caf\xe9"): one bad row; the file's other lines are UTF-8, the first
    # with a byte-order mark (as Windows editors save), which is not a bad row.
    path = tmp_path / "mixed.jsonl"
    rows = [json.dumps({"question": f"q{i}", "answer": str(i)}).encode() for i in range(4)]
    path.write_bytes(b"\xef\xbb\xbf" + rows[0] + b'\n{"question": "caf\xe9", "answer": "9"}\n' +
                     b"\n".join(rows[1:]) + b"\n")  # fmt: skip
    return path


def test_a_line_that_is_not_utf8_is_a_bad_row_at_file_and_line(tmp_path):
    # It stopped the whole load as "not UTF-8 text (... at byte 53)", even with skip_bad_rows.
    path = _rows_with_a_latin1_line(tmp_path)
    with pytest.raises(UserError, match=re.escape(f"{path}:2: not UTF-8 text (")):
        load_dataset(jsonl_cfg(path))
    data = load_dataset(jsonl_cfg(path, skip_bad_rows=True))
    # 4 good rows (lines 1, 3, 4, 5): 3 to train on and 1 held out; line 2 skipped.
    assert [t.answer for t in (*data.train, *data.held_out)] == ["0", "1", "2", "3"]
    assert len(data.skipped) == 1 and data.skipped[0].startswith(f"{path}:2: not UTF-8 text")


def test_the_whole_file_evaluation_set_extracts_and_skips_as_training_does(tmp_path):
    # eval.split=all read a jsonl file through a function the merge had lost (NameError).
    rows = [{"question": "a", "answer": "so #### 1,000"}, {"question": "b"}, {"question": "c",
            "answer": "#### 7"}]  # fmt: skip
    path = write_jsonl(tmp_path / "g.jsonl", rows)
    cfg = jsonl_cfg(path, answer_extract="gsm8k", skip_bad_rows=True)
    tasks = load_all_tasks(cfg)
    # Row 2 has no answer field: skipped; the ids are those training gives the two kept rows.
    assert [(t.task_id, t.answer) for t in tasks] == [("g/0", "1000"), ("g/1", "7")]
    assert [t.task_id for t in (*load_dataset(cfg).train, *load_dataset(cfg).held_out)] == [
        "g/0",
        "g/1",
    ]
