"""Tests for treadle.jobs.sft: noisy demonstrations, demonstration samples, and the SFT loop."""

from __future__ import annotations

import re

import pytest

from treadle.config import NoiseConfig, TinyModelConfig, TrainerConfig
from treadle.core.errors import UserError
from treadle.core.types import Message, Task
from treadle.jobs.sft import demonstration_samples, noisy_demonstration, run_sft
from treadle.store.data import render_prompt
from treadle.store.models import IM_END, build_tiny_model, build_tokenizer
from treadle.train.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STRICT = "<answer>{answer}</answer>"
STRICT_RE = re.compile(r"<answer>(-?\d+)</answer>")


def task(i: int, answer: str | None = None) -> Task:
    return Task(f"t/{i}", (Message("user", f"{i} + 1 ="),), answer or str(i + 1), "math")


def test_clean_noise_gives_the_gold_demonstration():
    assert noisy_demonstration(task(41), NoiseConfig(), STRICT, seed=0) == "<answer>42</answer>"


def test_noise_is_deterministic_per_task_and_seed():
    noise = NoiseConfig(loose_format_fraction=0.5, wrong_answer_fraction=0.5)
    tasks = [task(i) for i in range(200)]
    a = [noisy_demonstration(t, noise, STRICT, seed=0) for t in tasks]
    # Same task and seed: same output, also when asked in another order.
    assert [noisy_demonstration(t, noise, STRICT, seed=0) for t in reversed(tasks)] == a[::-1]
    # Another seed draws another noise pattern (200 tasks agreeing by chance: ~0.25^200).
    assert [noisy_demonstration(t, noise, STRICT, seed=1) for t in tasks] != a


def test_loose_format_fraction_over_many_tasks():
    noise = NoiseConfig(loose_format_fraction=0.5, loose_template="The answer is {answer}")
    demos = [noisy_demonstration(task(i), noise, STRICT, seed=0) for i in range(1000)]
    loose = [d for d in demos if d.startswith("The answer is ")]
    strict = [d for d in demos if STRICT_RE.fullmatch(d)]
    assert len(loose) + len(strict) == 1000
    # Binomial(1000, 0.5): std 15.8, so 450..550 is a +-3.2 sigma band.
    assert 450 <= len(loose) <= 550
    # The loose template still writes the right answer (wrong_answer_fraction is 0).
    assert all(
        d == f"The answer is {i + 1}" or d == f"<answer>{i + 1}</answer>"
        for i, d in enumerate(demos)
    )


def test_wrong_answers_are_off_by_one_to_three():
    noise = NoiseConfig(wrong_answer_fraction=0.3)
    deltas = []
    for i in range(1000):
        t = task(i, answer=str(i - 500))  # negative answers too
        got = int(STRICT_RE.fullmatch(noisy_demonstration(t, noise, STRICT, seed=3)).group(1))
        deltas.append(got - int(t.answer))
    wrong = [d for d in deltas if d != 0]
    # Binomial(1000, 0.3): std 14.5, so 250..350 is a +-3.4 sigma band.
    assert 250 <= len(wrong) <= 350
    assert set(wrong) == {-3, -2, -1, 1, 2, 3}  # every offset occurs, nothing else


def test_non_numeric_answers_are_never_made_wrong():
    noise = NoiseConfig(wrong_answer_fraction=1.0)
    t = task(0, answer="2 × 433")
    assert noisy_demonstration(t, noise, STRICT, seed=0) == "<answer>2 × 433</answer>"


def test_wrong_answer_changes_only_the_answer_field():
    t = Task("t/1", (Message("user", "2 + 3 ="),), "5", "math", reasoning="2 + 3 = 5.")
    noise = NoiseConfig(wrong_answer_fraction=1.0)
    demo = noisy_demonstration(t, noise, "{reasoning} <answer>{answer}</answer>", seed=0)
    worked, answer = re.fullmatch(r"(.*) <answer>(-?\d+)</answer>", demo).groups()
    assert worked == "2 + 3 = 5."  # the worked steps stay those of the gold solution
    assert int(answer) - 5 in {-3, -2, -1, 1, 2, 3}


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [f"{i} + 1 =" for i in range(50)] + [f"<answer>{i}</answer>" for i in range(50)]
    return build_tokenizer(corpus, vocab_size=300)


def test_demonstration_samples_train_only_the_reply_and_end_of_turn(tokenizer):
    tasks = [task(7), task(12)]
    noise = NoiseConfig(loose_format_fraction=0.5)
    samples = demonstration_samples(tasks, tokenizer, noise, STRICT, seed=0)
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    assert tokenizer.eos_token_id == eos
    for t, s in zip(tasks, samples, strict=True):
        prompt = render_prompt(tokenizer, t)
        demo = noisy_demonstration(t, noise, STRICT, seed=0)
        reply = [*tokenizer.encode(demo, add_special_tokens=False), eos]
        assert s.token_ids == prompt + reply
        assert s.loss_mask == [False] * len(prompt) + [True] * len(reply)
        trained = [tok for tok, m in zip(s.token_ids, s.loss_mask, strict=True) if m]
        assert tokenizer.decode(trained) == demo + IM_END
        assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
        assert len(s.behavior_logprobs) == len(s.advantages) == len(s.token_ids)
        assert s.group_id == t.task_id


def test_demonstration_samples_of_no_tasks_is_a_user_error(tokenizer):
    with pytest.raises(UserError, match="no demonstrations"):
        demonstration_samples([], tokenizer, NoiseConfig(), STRICT, seed=0)


def test_run_sft_lowers_the_demonstration_loss(tokenizer):
    tiny = TinyModelConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model = build_tiny_model(tiny, tokenizer, seed=0)
    samples = demonstration_samples(
        [task(3), task(4), task(5)], tokenizer, NoiseConfig(), STRICT, seed=0
    )
    backend = TorchBackend(model, TrainerConfig(lr=1e-2), total_steps=8)
    seen: list[tuple[int, dict[str, float]]] = []
    done = run_sft(
        backend,
        samples,
        steps=8,
        batch_size=2,
        seed=0,
        on_step=lambda step, m: seen.append((step, m)),
    )
    assert done == 8 and [step for step, _ in seen] == list(range(8))
    # No engine sampled demonstration tokens, so the rollout/train mismatch is not reported.
    assert all("mismatch/abs_logprob_diff" not in m for _, m in seen)
    losses = [m["loss"] for _, m in seen]
    assert losses[-1] < 0.75 * losses[0]  # about 5.6 -> 2.7 nats on this seed


def test_run_sft_stops_at_the_time_limit(tokenizer):
    model = build_tiny_model(
        TinyModelConfig(
            hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1
        ),
        tokenizer,
        seed=0,
    )
    samples = demonstration_samples([task(3)], tokenizer, NoiseConfig(), STRICT, seed=0)
    backend = TorchBackend(model, TrainerConfig(), total_steps=5)
    assert run_sft(backend, samples, steps=5, batch_size=1, seed=0, max_seconds=0.0) == 0


def test_superscript_digit_answer_is_treated_as_non_numeric():
    t = task(0, answer="²")
    assert noisy_demonstration(t, NoiseConfig(wrong_answer_fraction=1.0), STRICT, 0) == (
        "<answer>²</answer>"
    )
