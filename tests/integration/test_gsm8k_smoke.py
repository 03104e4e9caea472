"""Two RL steps on real GSM8K questions with the real Qwen3 tokenizer and chat template (with
``data.chat_template_kwargs`` turning Qwen3's thinking off).

The model is a tiny random one sized to Qwen3's vocabulary (no pretrained weights exist offline),
so this checks the plumbing, not learning: the files load, prompts are rendered by Qwen3's own
template, the engine and trainer handle a 151k-token vocabulary, and the losses are finite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from .runs import is_finite_number, run_python, step_rows, write_recipe
from .tiny import TINY_RECIPE_MODEL, vllm_import_error

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
"""``../shared/data`` beside the checkout: real public data that the published project lacks."""
GSM8K = SHARED_DATA / "gsm8k" / "test.jsonl"
QWEN3 = SHARED_DATA / "tokenizers" / "qwen3"
IM_START, IM_END = 151644, 151645  # Qwen3's <|im_start|>, <|im_end|>
NO_THINKING = "<think>\n\n</think>\n\n"
"""What Qwen3's template writes after the generation prompt with ``enable_thinking: false``."""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (GSM8K.is_file() and QWEN3.is_dir()),
        reason=f"needs the shared data folder ({GSM8K} and {QWEN3}); it is not part of the repo",
    ),
]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("gsm8k")
    engine = "vllm" if vllm_import_error() is None else "hf"
    recipe = {
        "run": {"name": "gsm8k", "output_dir": str(root / "runs"), "steps": 2, "save_every": 2},
        "model": {"tiny": {**TINY_RECIPE_MODEL, "tokenizer_path": str(QWEN3)}},
        "data": {
            "source": "jsonl",
            "path": str(GSM8K),
            "answer_pattern": r"####\s*(.+)$",
            "size": 16,
            "eval_size": 4,
            "chat_template_kwargs": {"enable_thinking": False},
        },
        "rollout": {"engine": engine, "prompts_per_step": 2, "n": 2, "max_tokens": 8},
        # A random model writes no <answer> tags: score the last number it writes, if any.
        "reward": {"functions": [{"name": "math_verify", "params": {"extract": "last_number"}}]},
        "eval": {"samples_per_prompt": 2},
    }
    path = write_recipe(root / "recipe.yaml", recipe)
    out = root / "prompts.json"
    driver = Path(__file__).with_name("record_prompts.py")
    run_python([str(driver), str(path), str(out)], cwd=root, timeout_s=900)
    return root / "runs" / "gsm8k", json.loads(out.read_text())


def test_two_rl_steps_with_finite_losses(smoke):
    run_dir, _ = smoke
    steps = step_rows(run_dir)
    assert sorted(steps) == [1, 2] and all(len(rows) == 1 for rows in steps.values())
    assert all(is_finite_number(rows[0]["loss"]) for rows in steps.values())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_after_rl"] <= 1.0


def test_model_is_sized_to_the_qwen3_vocabulary(smoke):
    run_dir, _ = smoke
    tokenizer = AutoTokenizer.from_pretrained(QWEN3)
    config = json.loads((run_dir / "base_model" / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer) == 151669
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 1
    saved = AutoTokenizer.from_pretrained(run_dir / "base_model")
    assert saved.get_vocab() == tokenizer.get_vocab()


def test_prompts_are_rendered_by_the_qwen3_chat_template_with_its_kwargs(smoke):
    _, prompts = smoke
    assert len(prompts) == 4  # 2 steps x 2 prompts
    tokenizer = AutoTokenizer.from_pretrained(QWEN3)
    questions = {json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[:16]}
    for record in prompts:
        ids = record["prompt_token_ids"]
        assert record["question"] in questions
        assert ids[0] == IM_START
        # The empty think block of data.chat_template_kwargs {enable_thinking: false} reaches
        # the engine: the training rollouts' prompts are rendered with it.
        text = f"<|im_start|>user\n{record['question']}<|im_end|>\n<|im_start|>assistant\n"
        assert tokenizer.decode(ids) == text + NO_THINKING
        assert ids == tokenizer.encode(text + NO_THINKING, add_special_tokens=False)
        assert ids.count(IM_START) == 2 and ids.count(IM_END) == 1
