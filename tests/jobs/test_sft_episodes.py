"""SFT demonstrations written by an environment's expert (the calculator's) and run through
the real environment: the tool's result is in the context and out of the loss. The byte
tokenizer here spends a token per character, so the episodes get a larger token budget."""

from __future__ import annotations

import pytest

from tests.rollout.environments_fakes import byte_tokenizer
from treadle.config import load_config
from treadle.core.errors import UserError
from treadle.core.types import Message, Task
from treadle.jobs.sft import episode_demonstration_samples

BYTES = ["environment.max_tokens=2000"]


def product(i: int, a: int, b: int) -> Task:
    question = f"Solve the following multiplication: {a} * {b}. Give only the result."
    return Task(f"p{i}", (Message("user", question),), str(a * b), "math")


def test_the_calculator_expert_calls_the_tool_then_answers_with_its_result():
    cfg = load_config("recipes/calculator.yaml", [*BYTES, "sft.noise.wrong_answer_fraction=0.0"])
    tokenizer = byte_tokenizer()
    (sample,) = episode_demonstration_samples(cfg, [product(0, 37, 41)], tokenizer)
    text = tokenizer.decode(sample.token_ids, skip_special_tokens=False)
    trained = tokenizer.decode(
        [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m],
        skip_special_tokens=False,
    )
    call = (
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "37 * 41"}}\n</tool_call>'
    )
    # 37 * 41 = 1517, computed by the tool and copied into the answer
    assert trained == f"{call}<|im_end|><answer>1517</answer><|im_end|>"
    assert "<|im_start|>tool\n1517<|im_end|>" in text  # the result: context, not trained


def test_a_share_of_demonstrations_guess_without_the_tool():
    cfg = load_config("recipes/calculator.yaml", BYTES)  # wrong_answer_fraction 0.5
    tasks = [product(i, 10 + i, 20 + i) for i in range(200)]
    samples = episode_demonstration_samples(cfg, tasks, byte_tokenizer())
    tokenizer = byte_tokenizer()
    guesses = 0
    for task, s in zip(tasks, samples, strict=True):
        text = tokenizer.decode(s.token_ids, skip_special_tokens=False)
        if "<tool_call>" not in text:
            guesses += 1
            assert f"<answer>{task.answer}</answer>" not in text  # off by 1 to 3
    assert 70 <= guesses <= 130  # 200 x 0.5, seeded per task


def test_a_question_without_an_expression_names_the_task():
    cfg = load_config("recipes/calculator.yaml", [*BYTES, "sft.noise.wrong_answer_fraction=0.0"])
    task = Task("q7", (Message("user", "Say hello."),), "hello", "math")
    with pytest.raises(UserError, match="task q7 has no arithmetic expression"):
        episode_demonstration_samples(cfg, [task], byte_tokenizer())


def test_a_demonstration_over_the_budget_is_refused_with_the_key_to_raise():
    cfg = load_config("recipes/calculator.yaml", ["sft.noise.wrong_answer_fraction=0.0"])
    with pytest.raises(UserError, match=r"1 of 1 demonstration .* raise environment\.max_tokens"):
        episode_demonstration_samples(cfg, [product(0, 37, 41)], byte_tokenizer())
