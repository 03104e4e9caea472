"""The reward-model reward on a real (tiny, locally trained) sequence-classification model."""

from __future__ import annotations

import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config

from treadle.core.errors import UserError
from treadle.core.types import Message, Task
from treadle.rewards.base import build_reward_function
from treadle.rewards.pool import RewardPool
from treadle.rewards.reward_model import RewardModelReward
from treadle.store.models import build_tokenizer

from .tiny_rm import pair, train_tiny_reward_model


def arithmetic(a: int, b: int) -> Task:
    return Task(f"add/{a}/{b}", (Message("user", f"What is {a} + {b}?"),), str(a + b), "math")


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    return train_tiny_reward_model(tmp_path_factory.mktemp("rm"))


SAMPLES = [
    (arithmetic(3, 4), "<answer>7</answer>"),
    (arithmetic(25, 28), "53"),
    (arithmetic(1, 1), "I think it is <answer>2</answer>, because one and one make two."),
    (arithmetic(9, 0), ""),
]


def reference_rewards(folder: Path, samples) -> list[float]:
    """Each sample alone (no padding) through HF's own forward: the logit at the last token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    out = []
    for task, response in samples:
        chat = [{"role": "user", "content": task.messages[0].content}]
        chat.append({"role": "assistant", "content": response})
        ids = tok.apply_chat_template(chat, tokenize=False)
        enc = tok(ids, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            out.append(model(**enc).logits[0, 0].item())
    return out


def test_batched_scores_equal_each_sequence_scored_alone(rm_dir: Path) -> None:
    expected = reference_rewards(rm_dir, SAMPLES)
    for batch_size in ("1", "3", "16"):  # 3: a length-sorted batch of three, then one alone
        rm = RewardModelReward(str(rm_dir), placement="colocated", batch_size=batch_size)
        got = [s.reward for s in rm.score_batch(SAMPLES)]
        assert got == pytest.approx(expected, abs=1e-5)
    # correct is reward >= threshold (0 by default)
    assert [s.correct for s in rm.score_batch(SAMPLES)] == [r >= 0 for r in expected]


def test_trained_model_prefers_the_tagged_answer_on_unseen_sums(rm_dir: Path) -> None:
    rm = RewardModelReward(str(rm_dir), placement="colocated")
    unseen = [(a, b) for a in range(20, 30) for b in range(20, 25)]  # never trained on
    samples = [(arithmetic(a, b), r) for a, b in unseen for r in pair(a, b)]
    scores = [s.reward for s in rm.score_batch(samples)]
    wins = sum(scores[2 * i] > scores[2 * i + 1] for i in range(len(unseen)))
    assert wins == len(unseen)


def test_colocated_starts_no_forward_after_the_time_it_is_given(rm_dir: Path) -> None:
    # The pool passes the time left to its step deadline; with none left, nothing is computed.
    rm = RewardModelReward(str(rm_dir), placement="colocated", batch_size="1")
    assert len(rm.score_batch(SAMPLES, timeout_s=600.0)) == len(SAMPLES)
    with pytest.raises(TimeoutError, match="after 0 of"):
        rm.score_batch(SAMPLES, timeout_s=0.0)


def test_separate_process_gives_the_same_scores(rm_dir: Path) -> None:
    colocated = RewardModelReward(str(rm_dir), placement="colocated")
    separate = RewardModelReward(str(rm_dir), placement="separate", threads="1")
    try:
        got = [s.reward for s in separate.score_batch(SAMPLES)]
        assert got == pytest.approx([s.reward for s in colocated.score_batch(SAMPLES)], abs=1e-5)
        assert separate.worker_pid() not in (None, os.getpid())
        # score() is score_batch() of a batch of one: no padding and another batch shape, so
        # the matmuls may block and round differently (1 float32 ULP at 3.06 is 2.4e-7; seen on
        # an AVX2-only CPU). 1e-5 is the tolerance of the batch-invariance checks above.
        alone = separate.score(*SAMPLES[0])
        assert alone.reward == pytest.approx(got[0], abs=1e-5)
        assert alone.correct == (got[0] >= 0)
    finally:
        separate.close()


def test_separate_worker_timeout_and_death_give_fallback_and_a_fresh_worker(rm_dir: Path) -> None:
    rm = RewardModelReward(str(rm_dir), placement="separate", timeout_s="60")
    pool = RewardPool([(rm, 1.0)], workers=0, fallback=-5.0)
    try:
        good = pool.score(SAMPLES)
        assert good.failures == good.timeouts == 0
        first = rm.worker_pid()
        # A batch over its time: every sample of it times out and gets the fallback.
        rm.timeout_s = 1e-4
        slow = pool.score(SAMPLES)
        assert slow.timeouts == len(SAMPLES) and slow.failures == 0
        assert [s.reward for s in slow.scores] == [-5.0] * len(SAMPLES)
        assert slow.failed == [True] * len(SAMPLES)
        rm.timeout_s = 60.0
        again = pool.score(SAMPLES)  # a new worker loads the model again
        assert [s.reward for s in again.scores] == [s.reward for s in good.scores]
        second = rm.worker_pid()
        assert second != first
        # The worker killed between batches is replaced before the next one, which scores.
        os.kill(second, signal.SIGKILL)
        time.sleep(0.5)
        assert [s.reward for s in pool.score(SAMPLES).scores] == [s.reward for s in good.scores]
        third = rm.worker_pid()
        assert third not in (first, second)
    finally:
        pool.close()


def test_separate_worker_killed_mid_batch_fails_that_batch_only(rm_dir: Path) -> None:
    rm = RewardModelReward(str(rm_dir), placement="separate", batch_size="1")
    pool = RewardPool([(rm, 1.0)], workers=0, fallback=-5.0)
    try:
        good = pool.score(SAMPLES)  # loads the model in the worker
        pid = rm.worker_pid()
        many = [(task, f"{r} {i}") for i, (task, r) in enumerate(SAMPLES * 1000)]
        killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))  # 4000 forwards take >1 s
        killer.start()
        dead = pool.score(many)
        killer.join()
        assert dead.failures == len(many) and dead.timeouts == 0
        assert {s.reward for s in dead.scores} == {-5.0}
        assert [s.reward for s in pool.score(SAMPLES).scores] == [s.reward for s in good.scores]
        assert rm.worker_pid() != pid
    finally:
        pool.close()


def test_pool_routes_weights_and_caches_with_per_sample_functions(rm_dir: Path) -> None:
    rm = RewardModelReward(str(rm_dir), placement="colocated")
    chat = Task("chat/0", (Message("user", "What is 3 + 4?"),), "", "chat")
    samples = [
        (arithmetic(3, 4), "<answer>7</answer>"),
        (arithmetic(3, 4), "<answer>7</answer>"),  # identical pair: scored once
        (arithmetic(3, 4), "<answer>8</answer>"),
        (chat, "<answer>7</answer>"),
    ]
    r7, r8 = (s.reward for s in rm.score_batch([samples[0], samples[2]]))
    r_chat = rm.score_batch([samples[3]])[0].reward
    verifier = build_reward_function("math_verify")
    with RewardPool(
        [(verifier, 1.0), (rm, 0.5)], workers=1, domains=[["math"], ["math", "chat"]]
    ) as pool:
        batch = pool.score(samples)
    # math: 1 * verifier + 0.5 * rm; chat: only the reward model is routed (0.5 * rm), and it
    # is the primary function there, so its threshold decides "correct".
    expected = [1 + 0.5 * r7, 1 + 0.5 * r7, 0 + 0.5 * r8, 0.5 * r_chat]
    assert [s.reward for s in batch.scores] == pytest.approx(expected, abs=1e-5)
    assert [s.correct for s in batch.scores] == [True, True, False, r_chat >= 0]
    assert batch.cached == 1 and batch.failures == batch.timeouts == 0


def test_bad_settings_are_refused_before_loading(rm_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"params\.path"):
        build_reward_function("reward_model")
    with pytest.raises(UserError, match=r"no config\.json"):
        build_reward_function("reward_model", path=str(tmp_path))
    with pytest.raises(UserError, match="placement"):
        build_reward_function("reward_model", path=str(rm_dir), placement="remote")
    with pytest.raises(UserError, match="dtype"):
        build_reward_function("reward_model", path=str(rm_dir), dtype="float16")
    with pytest.raises(UserError, match="device"):
        build_reward_function("reward_model", path=str(rm_dir), device="tpu")
    with pytest.raises(UserError, match="batch_size"):
        build_reward_function("reward_model", path=str(rm_dir), batch_size="0")
    with pytest.raises(UserError, match="finite"):
        build_reward_function("reward_model", path=str(rm_dir), timeout_s="nan")
    with pytest.raises(UserError, match="finite"):
        build_reward_function("reward_model", path=str(rm_dir), threshold="inf")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="device cuda:1 is not available"):
            build_reward_function("reward_model", path=str(rm_dir), device="cuda:1")
    with pytest.raises(UserError, match="device must be"):
        build_reward_function("reward_model", path=str(rm_dir), device="cuda:x")
    two = tmp_path / "two"
    shutil.copytree(rm_dir, two)
    config = Qwen2Config.from_pretrained(rm_dir)
    config.num_labels = 2
    config.save_pretrained(two)
    with pytest.raises(UserError, match="num_labels=2"):
        build_reward_function("reward_model", path=str(two))
    (two / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot load"):
        build_reward_function("reward_model", path=str(two))
    (two / "config.json").write_text('{"hidden_size": 8}')  # no model_type
    with pytest.raises(UserError, match="cannot load"):
        build_reward_function("reward_model", path=str(two))
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(rm_dir / "config.json", empty)
    with pytest.raises(UserError, match="no weights"):
        build_reward_function("reward_model", path=str(empty))


def tiny_tokenizer_dir(folder: Path, chat_template: bool) -> Path:
    corpus = [f"What is {a} + {b}? <answer>{a + b}</answer>" for a in range(10) for b in range(10)]
    tok = build_tokenizer(corpus, 300)
    if not chat_template:  # a BERT-style tokenizer: [CLS] a [SEP] b [SEP] with token types
        from tokenizers import processors

        tok.chat_template = None
        tok.add_special_tokens({"cls_token": "[CLS]", "sep_token": "[SEP]"})
        cls, sep = tok.convert_tokens_to_ids(["[CLS]", "[SEP]"])
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
        )
    tok.save_pretrained(folder)
    return folder


def alone_scores(rm: RewardModelReward, samples) -> list[float]:
    return [rm.score_batch([s])[0].reward for s in samples]


def test_encoders_read_the_pair_and_are_batch_invariant(tmp_path: Path) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    folder = tiny_tokenizer_dir(tmp_path / "bert", chat_template=False)
    tok = AutoTokenizer.from_pretrained(folder)
    config = BertConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, num_labels=1, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    rm = RewardModelReward(str(folder), placement="colocated", batch_size="8")
    batched = [s.reward for s in rm.score_batch(SAMPLES)]
    assert batched == pytest.approx(alone_scores(rm, SAMPLES), abs=1e-5)
    # The input is the pair (prompt, response) with token type ids, as encoder RMs are trained.
    model = BertForSequenceClassification.from_pretrained(folder).eval()
    task, response = SAMPLES[0]
    enc = tok(task.messages[0].content, response, return_tensors="pt", return_token_type_ids=True)
    assert enc["token_type_ids"].sum() > 0
    with torch.inference_mode():
        assert batched[0] == pytest.approx(model(**enc).logits[0, 0].item(), abs=1e-5)


def test_other_architectures_are_scored_alone_and_long_inputs_fit_the_context(tmp_path):
    from transformers import XLNetConfig, XLNetForSequenceClassification

    folder = tiny_tokenizer_dir(tmp_path / "xlnet", chat_template=True)
    tok = AutoTokenizer.from_pretrained(folder)
    config = XLNetConfig(
        vocab_size=len(tok), d_model=32, n_layer=1, n_head=2, d_inner=64, num_labels=1,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    XLNetForSequenceClassification(config).save_pretrained(folder)
    rm = RewardModelReward(str(folder), placement="colocated", batch_size="8")
    # XLNet reads its last position: padded batches would change scores, so none are formed.
    batched = [s.reward for s in rm.score_batch(SAMPLES)]
    assert batched == pytest.approx(alone_scores(rm, SAMPLES), abs=1e-5)


def test_max_length_is_capped_to_the_model_context(rm_dir: Path) -> None:
    rm = RewardModelReward(str(rm_dir), placement="colocated", max_length="100000")
    assert rm.max_length == 256  # the tiny RM's max_position_embeddings
    long = (arithmetic(1, 2), "<answer>3</answer> " + "and so on " * 400)
    (score,) = rm.score_batch([long])
    assert math.isfinite(score.reward)  # the beginning was cut, the model read 256 tokens
