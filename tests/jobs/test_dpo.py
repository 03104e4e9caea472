"""Tests for treadle.jobs.dpo: preference pairs, the DPO step on a tiny real model, the command."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch
from integration.tiny import build_tiny_folder, snapshot, unchanged

from treadle.cli import main
from treadle.config import DPOConfig, NoiseConfig, TrainerConfig, load_config
from treadle.core.errors import UserError
from treadle.core.types import Message, Task
from treadle.jobs.dpo import (
    PreferencePair,
    dpo_step,
    load_pairs,
    pair_samples,
    read_pairs,
    run_dpo,
    sequence_logprobs,
    synthesise_pairs,
)
from treadle.jobs.sft import noisy_demonstration
from treadle.store.models import IM_END, load_model
from treadle.store.observe import read_metrics
from treadle.train.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "dpo.yaml"


def pair_line(a: int, b: int) -> str:
    """A pair preferring the right sum over the sum plus one."""
    return json.dumps(
        {
            "prompt": f"What is {a} + {b}?",
            "chosen": f"<answer>{a + b}</answer>",
            "rejected": f"<answer>{a + b + 1}</answer>",
        }
    )


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny_folder(folder)
    return folder


@pytest.fixture
def pairs_file(tmp_path) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(pair_line(a, b) for a in range(4) for b in range(5)) + "\n")
    return path


# ----------------------------------------------------------------------------- pairs


def test_read_pairs_takes_a_string_or_a_message_list_as_prompt(tmp_path):
    path = tmp_path / "p.jsonl"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    rows = [
        {"q": "1+1?", "good": "2", "bad": "3"},
        {"q": messages, "good": "4", "bad": "5"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")  # a blank line is skipped
    cfg = DPOConfig(path=str(path), prompt_field="q", chosen_field="good", rejected_field="bad")
    a, b = read_pairs(cfg)
    assert a.task.messages == (Message("user", "1+1?"),) and (a.chosen, a.rejected) == ("2", "3")
    assert b.task.messages == (Message("system", "Be brief."), Message("user", "2+2?"))
    assert a.task.task_id == f"{path}:1" and b.task.task_id == f"{path}:2"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"prompt": "q", "rejected": "r"}', ":2: no field 'chosen' (dpo.chosen_field)"),
        ('{"prompt": "q", "chosen": 3, "rejected": "r"}', ":2: field 'chosen' (dpo.chosen_field)"),
        ('{"prompt": 7, "chosen": "c", "rejected": "r"}', ":2: field 'prompt' (dpo.prompt_field)"),
        ('{"prompt": "q", chosen}', ":2: malformed JSON line"),
        ("[1, 2]", ":2: expected a JSON object"),
    ],
)
def test_a_bad_line_names_file_line_and_key(tmp_path, line, expected):
    path = tmp_path / "p.jsonl"
    path.write_text(pair_line(1, 2) + "\n" + line + "\n")
    with pytest.raises(UserError, match="^" + re.escape(str(path) + expected)):
        read_pairs(DPOConfig(path=str(path)))


def test_too_few_pairs_to_hold_one_out(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(pair_line(1, 2) + "\n")
    with pytest.raises(UserError, match="1 preference pairs; need at least 2"):
        read_pairs(DPOConfig(path=str(path)))


def test_file_pairs_hold_out_a_tenth(pairs_file):
    cfg = load_config(RECIPE, [f"dpo.path={pairs_file}"])
    split = load_pairs(cfg, None)
    # 20 pairs: 20 // 10 = 2 held out, 18 trained on, none in both.
    assert (len(split.train), len(split.held_out)) == (18, 2)
    assert not {p.task.task_id for p in split.train} & {p.task.task_id for p in split.held_out}


def test_synthesised_pairs_are_gold_versus_a_wrong_answer():
    template = "{reasoning} <answer>{answer}</answer>"
    tasks = [
        Task(f"t/{i}", (Message("user", f"{i} + 2 ="),), str(i + 2), "math", reasoning="r.")
        for i in range(-5, 5)
    ]
    no_integer = Task("t/x", (Message("user", "spell 2"),), "two", "math", reasoning="r.")
    pairs = synthesise_pairs([*tasks, no_integer], template, seed=0)
    assert [p.task for p in pairs] == tasks  # the non-integer answer gives no pair
    for p in pairs:
        assert p.chosen == f"r. <answer>{p.task.answer}</answer>"
        wrong = int(p.rejected.removeprefix("r. <answer>").removesuffix("</answer>"))
        assert wrong - int(p.task.answer) in {-3, -2, -1, 1, 2, 3}
        # The same wrong answer the SFT noise would write for this task and seed.
        wrong_only = NoiseConfig(wrong_answer_fraction=1.0)
        assert p.rejected == noisy_demonstration(p.task, wrong_only, template, seed=0)


def test_pair_samples_train_only_the_responses_and_end_of_turn(tiny_folder):
    _, tokenizer = load_model(tiny_folder)
    pair = PreferencePair(
        Task("t", (Message("user", "What is 1 + 2?"),), "", ""),
        "<answer>3</answer>",
        "<answer>4</answer>",
    )
    (s,) = pair_samples([pair], tokenizer, max_len=512)
    for sample, text in ((s.chosen, pair.chosen), (s.rejected, pair.rejected)):
        trained = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
        assert tokenizer.decode(trained) == text + IM_END
        prompt = sample.token_ids[: sample.loss_mask.index(True)]
        assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    with pytest.raises(UserError, match=r"pair t is .* tokens, over the model's context of 8"):
        pair_samples([pair], tokenizer, max_len=8)


# ----------------------------------------------------------------------------- the DPO step


def test_micro_batches_accumulate_to_the_mean_over_pairs(tiny_folder, pairs_file):
    """One step in one micro-batch and in one micro-batch per pair accumulates the same
    gradient (of the mean loss over the pairs), and its loss is ln 2: the packed training
    forward agrees with the reference's."""
    model, tokenizer = load_model(tiny_folder)
    pairs = pair_samples(read_pairs(DPOConfig(path=str(pairs_file)))[:6], tokenizer, 512)
    reference = TorchBackend(copy.deepcopy(model), TrainerConfig(), 1, trainable=False)
    ref = sequence_logprobs(reference, pairs)
    grads = []
    for budget in (4096, 16):  # 16 tokens: every pair is longer, so each gets its own
        # No clipping, so the gradients left after the step are the accumulated ones.
        trainer = TrainerConfig(micro_batch_tokens=budget, grad_clip=0.0)
        policy = TorchBackend(copy.deepcopy(model), trainer, 1)
        m = dpo_step(policy, pairs, ref, beta=0.1)
        assert m["perf/micro_batches"] == (1 if budget == 4096 else 6)
        # Policy = reference: every margin is 0 and the loss -log sigmoid(0) = ln 2.
        assert m["loss"] == pytest.approx(math.log(2), abs=1e-5)
        assert m["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-4)
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters()})
    for name, value in grads[0].items():
        torch.testing.assert_close(value, grads[1][name], rtol=1e-4, atol=1e-7, msg=name)


def test_dpo_raises_the_margin_of_trained_pairs(tiny_folder, pairs_file, tmp_path):
    cfg = load_config(
        RECIPE,
        [
            f"model.path={tiny_folder}",
            "sft.steps=0",
            f"dpo.path={pairs_file}",
            f"run.output_dir={tmp_path / 'runs'}",
            "run.threads=1",
            "dpo.steps=8",
            "dpo.batch_size=6",
            "dpo.lr=1e-3",
            "trainer.micro_batch_tokens=64",
        ],
    )
    folder = run_dpo(cfg)
    run_dir = tmp_path / "runs" / "dpo"
    assert folder == run_dir / "dpo_model"

    rows = [r for r in read_metrics(run_dir / "dpo" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in rows)
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy = reference
    assert rows[-1]["loss"] < rows[0]["loss"]

    base, tokenizer = load_model(tiny_folder)
    trained, _ = load_model(folder)
    assert not unchanged(snapshot(base), trained), "some parameters did not change"

    # Margin of a trained pair: (policy - reference) of chosen minus the same of rejected; it is
    # 0 before training (policy = reference), so DPO must have made it positive.
    pair = pair_samples(load_pairs(cfg, None).train[:1], tokenizer, 512)
    ref = sequence_logprobs(TorchBackend(base, cfg.trainer, 1, trainable=False), pair)
    now = sequence_logprobs(TorchBackend(trained, cfg.trainer, 1, trainable=False), pair)
    margin = (now.chosen - ref.chosen) - (now.rejected - ref.rejected)
    assert margin.item() > 0.1

    summary = json.loads((run_dir / "dpo_summary.json").read_text())
    assert summary["held_out_pairs"] == 2 and summary["train_pairs"] == 18
    assert summary["reward_margin_before"] == pytest.approx(0.0, abs=1e-4)
    assert math.isfinite(summary["reward_margin_after"])


# ----------------------------------------------------------------------------- the command


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("dpo.steps=0", "dpo.steps: must be at least 1"),
        ("dpo.batch_size=0", "dpo.batch_size: must be at least 1"),
        ("dpo.beta=0", "dpo.beta: must be positive"),
        ("dpo.lr=-1e-5", "dpo.lr: must be positive"),
        ("dpo.betta=0.1", "did you mean dpo.beta?"),
    ],
)
def test_bad_dpo_config_names_the_key(override, expected):
    with pytest.raises(UserError, match=re.escape(expected)):
        load_config(RECIPE, [override])


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "dpo.path {file}: file not found"),
        (pair_line(1, 2) + '\n{"prompt": "q", oops}\n', "{file}:2: malformed JSON line"),
        (pair_line(1, 2) + '\n{"prompt": "q", "chosen": "c"}\n', "{file}:2: no field 'rejected'"),
    ],
)
def test_bad_pairs_exit_2_with_one_line_and_no_run_dir(
    tiny_folder, tmp_path, capsys, content, expected
):
    file = tmp_path / "pairs.jsonl"
    if content is not None:
        file.write_text(content)
    runs = tmp_path / "runs"
    args = [f"dpo.path={file}", f"model.path={tiny_folder}", f"run.output_dir={runs}"]
    assert main(["dpo", str(RECIPE), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("treadle: error: "), err
    assert expected.format(file=file) in err
    assert not runs.exists()


def test_lora_dpo_trains_adapters_against_the_adapter_disabled_reference(
    tiny_folder, pairs_file, tmp_path
):
    cfg = load_config(
        RECIPE,
        [
            f"model.path={tiny_folder}",
            "sft.steps=0",
            f"dpo.path={pairs_file}",
            f"run.output_dir={tmp_path / 'runs'}",
            "run.threads=1",
            "dpo.steps=8",
            "dpo.batch_size=6",
            "dpo.lr=1e-2",
            "trainer.micro_batch_tokens=64",
            "model.lora.r=4",
        ],
    )
    folder = run_dpo(cfg)
    rows = [
        r for r in read_metrics(tmp_path / "runs" / "dpo" / "dpo" / "metrics.jsonl") if "loss" in r
    ]
    # B starts at 0: the policy is its own adapter-disabled reference, so the loss is log 2
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[-1]["loss"] < rows[0]["loss"]
    base, tokenizer = load_model(tiny_folder)
    trained, _ = load_model(folder)  # merged: a plain Hugging Face model
    assert (folder / "adapter" / "adapter_model.safetensors").is_file()
    b, t = base.state_dict(), trained.state_dict()
    assert torch.equal(b["model.embed_tokens.weight"], t["model.embed_tokens.weight"])
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(b[q], t[q])
    pair = pair_samples(load_pairs(cfg, None).train[:1], tokenizer, 512)
    ref = sequence_logprobs(TorchBackend(base, cfg.trainer, 1, trainable=False), pair)
    now = sequence_logprobs(TorchBackend(trained, cfg.trainer, 1, trainable=False), pair)
    assert ((now.chosen - ref.chosen) - (now.rejected - ref.rejected)).item() > 0.1
