"""A LoRA run (``model.lora.r=4``, merged sync to the HF engine, a KL reference) on the tiny
model: checkpoints hold the adapter only, a resumed run equals an uninterrupted one, the
final model is a plain Hugging Face folder that ``treadle eval`` reads."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM

from treadle.cli import main
from treadle.config import load_config
from treadle.jobs.train import train

from .runs import TINY_RUN, step_rows
from .tiny import skip_without_vllm

LORA = [*TINY_RUN, "model.lora.r=4", "algorithm.kl.coef=0.1", "trainer.lr=1e-2"]


def run(output_dir, name: str, steps: int, resume=None) -> dict:
    overrides = [*LORA, f"run.output_dir={output_dir}", f"run.name={name}", f"run.steps={steps}"]
    return train(load_config(None, overrides), resume=resume, console=Console(file=io.StringIO()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    run(out, "resumed", steps=1)
    run(out, "resumed", steps=2, resume=out / "resumed")
    summary = run(out, "straight", steps=2)
    return out / "resumed", out / "straight", summary


@pytest.mark.slow
def test_checkpoint_holds_the_adapter_only_and_names_the_base(runs):
    _, straight, summary = runs
    model_dir = straight / "checkpoints" / "step_000002" / "model"
    assert (model_dir / "adapter_model.safetensors").is_file()
    assert not (model_dir / "model.safetensors").exists()
    config = json.loads((model_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(straight / "base_model")
    # tiny model (hidden 64, MLP 128, 1 layer, 2 heads of 32, 1 KV head: k, v 64 -> 32), r 4:
    # q, o 4 x 128 = 512 each; k, v 4 x 96 = 384 each; gate, up, down 4 x 192 = 768 each
    # = 4096 trainable parameters
    assert summary["lora_trainable_params"] == 4096
    assert 0 < summary["lora_trainable_share"] < 0.1
    assert 0 < summary["lora_checkpoint_bytes"] < 1_000_000


@pytest.mark.slow
def test_resumed_lora_run_equals_an_uninterrupted_one(runs):
    resumed, straight, _ = runs
    a, b = step_rows(resumed)[2][0], step_rows(straight)[2][0]
    assert b["kl/k3"] > 0  # the adapter-disabled reference differs from the policy after step 1
    for key in ("reward/mean", "loss", "grad_norm", "kl/k3"):
        assert a[key] == pytest.approx(b[key], abs=1e-6), key
    ma = AutoModelForCausalLM.from_pretrained(resumed / "final_model")
    mb = AutoModelForCausalLM.from_pretrained(straight / "final_model")
    pb = dict(mb.named_parameters())
    for name, p in ma.named_parameters():
        torch.testing.assert_close(p, pb[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_final_model_is_merged_and_differs_from_the_base(runs):
    _, straight, _ = runs
    final = AutoModelForCausalLM.from_pretrained(straight / "final_model").state_dict()
    base = AutoModelForCausalLM.from_pretrained(straight / "base_model").state_dict()
    assert (straight / "final_model" / "adapter" / "adapter_model.safetensors").is_file()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (final[q] - base[q]).abs().max() > 0  # B A merged in
    e = "model.embed_tokens.weight"
    assert torch.equal(final[e], base[e])  # not a target: untouched


@pytest.mark.slow
def test_eval_reads_the_lora_runs_final_model(runs):
    _, straight, _ = runs
    assert main(["eval", str(straight)]) == 0
    assert (straight / "eval" / "held_out" / "summary.json").is_file()


@pytest.mark.slow
def test_adapter_sync_run_with_vllm_sends_only_the_adapter(tmp_path):
    skip_without_vllm()
    overrides = [
        *LORA,
        "rollout.engine=vllm",
        "model.lora.sync=adapter",
        f"run.output_dir={tmp_path}",
        "run.name=adapter",
        "run.steps=2",
    ]
    summary = train(load_config(None, overrides), console=Console(file=io.StringIO()))
    assert summary["rl_steps"] == 2 and 0 <= summary["accuracy_after_rl"] <= 1
    rows = step_rows(tmp_path / "adapter")
    # the 4096 adapter parameters (see above) x 4 bytes (fp32) each sync
    assert [rows[s][0]["sync/bytes"] for s in (1, 2)] == [16_384, 16_384]
