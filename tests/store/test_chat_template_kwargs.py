"""``data.chat_template_kwargs`` reach the chat template where prompts are rendered: Qwen3's
``enable_thinking`` with the real Qwen3 tokenizer (from ``../shared/data``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from treadle.core.types import Message, Task
from treadle.store.data import render_prompt

QWEN3 = Path(__file__).resolve().parents[3] / "shared" / "data" / "tokenizers" / "qwen3"
"""Qwen3's tokenizer and chat template, in ``../shared/data`` beside the checkout."""

EMPTY_THINK = "<think>\n\n</think>\n\n"
"""What Qwen3's template writes after the generation prompt when thinking is off."""


@pytest.fixture(scope="module")
def qwen3():
    if not (QWEN3 / "tokenizer_config.json").is_file():
        pytest.skip(f"needs the Qwen3 tokenizer at {QWEN3} (../shared/data beside the checkout)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN3)


TASK = Task("t/0", (Message("user", "What is 2 + 3?"),), "5", "math")


def test_enable_thinking_false_renders_the_empty_think_block(qwen3):
    off = qwen3.decode(render_prompt(qwen3, TASK, {"enable_thinking": False}))
    on = qwen3.decode(render_prompt(qwen3, TASK, {"enable_thinking": True}))
    default = qwen3.decode(render_prompt(qwen3, TASK))
    head = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert off == head + EMPTY_THINK
    assert on == head == default  # thinking on is the template's default: no block written


def test_check_context_measures_prompts_rendered_with_the_kwargs(qwen3):
    # check_context measures prompts as the engine receives them: 4 more tokens with the empty
    # think block ("<think>", "\n\n", "</think>", "\n\n" are one token each in Qwen3's vocabulary).
    from treadle.jobs.compose import check_context
    from treadle.store.data import Dataset

    data = Dataset(train=(TASK,), held_out=(TASK,))
    on = check_context(qwen3, data, 16, 4096)
    off = check_context(qwen3, data, 16, 4096, {"enable_thinking": False})
    assert off - on == len(qwen3.encode(EMPTY_THINK, add_special_tokens=False)) == 4


class _Engine:
    """Records the prompts it is given; samples nothing."""

    def __init__(self):
        self.prompts = []

    def generate(self, prompts, params):
        self.prompts += prompts
        return [() for _ in prompts]


def test_generate_renders_rollout_and_evaluation_prompts_with_the_kwargs(qwen3):
    from treadle.core.protocols import SamplingParams
    from treadle.rollout.generate import generate

    engine = _Engine()
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=4)
    (g,) = generate(engine, qwen3, [TASK], params, {"enable_thinking": False})
    assert qwen3.decode(g.prompt_token_ids).endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    assert engine.prompts == [g.prompt_token_ids]
