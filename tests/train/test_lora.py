"""Tests for treadle.train.lora on a tiny fp32 Qwen2 (vocab 64, hidden 32, MLP 64, 2 layers,
2 heads of 16, 1 KV head): only the adapters train, the base stays bit-equal, the reference is
the base model, merged weights equal PEFT's merge, and the adapter sync is small."""

from __future__ import annotations

import re

import pytest
import torch

from treadle.config import LoraConfig, TrainerConfig
from treadle.core.errors import UserError
from treadle.core.types import TrainSample
from treadle.train import lora
from treadle.train.objectives import SFTObjective
from treadle.train.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NO_CLIP = 1e6


def sample(prompt: list[int], completion: list[int], advantage: float, group: str) -> TrainSample:
    p, n = len(prompt), len(completion)
    return TrainSample(
        prompt + completion,
        [False] * p + [True] * n,
        [0.0] * (p + n),
        [0.0] * p + [advantage] * n,
        0,
        group,
    )


SAMPLES = [
    sample([1, 2, 3], [4, 5, 6], 1.0, "a"),
    sample([1, 2, 3], [7, 8], -1.0, "a"),  # shares group a's prompt
    sample([9, 10], [11, 12, 13, 14], 0.5, "b"),
]


def lora_model(tiny_qwen2, r: int = 4, **kw):
    """The tiny model with LoRA adapters, B randomised (PEFT starts B at 0, which would make
    every merged/disabled comparison trivially true)."""
    model = lora.apply_lora(tiny_qwen2(0), LoraConfig(r=r, alpha=8.0, **kw))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def lora_backend(model, **cfg) -> TorchBackend:
    return TorchBackend(model, TrainerConfig(grad_clip=NO_CLIP, **cfg), total_steps=10)


def test_unknown_target_module_is_refused_naming_the_models_linears(tiny_qwen2):
    with pytest.raises(UserError, match=r"model.lora.target_modules.*'q_proj'.*all-linear"):
        lora.apply_lora(tiny_qwen2(0), LoraConfig(r=4, target_modules=["qkv_proj"]))


def test_an_adapter_on_a_tied_output_layer_is_refused(tiny_qwen2):
    from conftest import tiny_qwen2_config
    from transformers import Qwen2ForCausalLM

    untied = tiny_qwen2(0)
    assert not untied.config.tie_word_embeddings  # an untied lm_head takes an adapter
    lora.apply_lora(untied, LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    model = Qwen2ForCausalLM(tiny_qwen2_config(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(UserError, match=r"model.lora.target_modules: lm_head shares its weight"):
        lora.apply_lora(model, LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))


def test_trainable_share_counts_the_adapters_by_hand(tiny_qwen2):
    model = lora.apply_lora(tiny_qwen2(0), LoraConfig(r=4))
    # per layer, r * (in + out): q 32->32: 4*64=256; k, v 32->16 (1 KV head of 16): 4*48=192
    # each; o 32->32: 256; gate, up 32->64: 4*96=384 each; down 64->32: 384
    # = 256 + 192 + 192 + 256 + 384 * 3 = 2048 per layer, x 2 layers = 4096
    trainable, total = lora.trainable_share(model)
    assert trainable == 4096
    assert total == sum(p.numel() for p in tiny_qwen2(0).parameters()) + 4096


def test_packing_through_peft_is_shared_and_optimizer_holds_only_adapters(tiny_qwen2):
    b = lora_backend(lora_model(tiny_qwen2))
    assert b.packing == "shared"
    assert b._logits_to_keep
    held = {id(p) for g in b.optimizer.param_groups for p in g["params"]}
    names = [n for n, p in b.model.named_parameters() if id(p) in held]
    assert len(names) == 2 * 7 * 2 and all("lora_" in n for n in names)  # A, B x 7 x 2 layers


def test_step_changes_only_adapters_base_bit_equal(tiny_qwen2):
    model = lora_model(tiny_qwen2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    b = lora_backend(model, lr=1e-2)
    b.train_step(SAMPLES, SFTObjective())
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert not torch.equal(p, before[n]), n
        else:
            assert torch.equal(p, before[n]), n


def test_reference_is_the_base_model(tiny_qwen2):
    model = lora_model(tiny_qwen2)
    b = lora_backend(model)
    ref = lora.AdapterDisabledReference(b).compute_logprobs(SAMPLES)
    base = TorchBackend(tiny_qwen2(0), TrainerConfig(), 1, trainable=False)
    expected = base.compute_logprobs(SAMPLES)
    for got, want in zip(ref, expected, strict=True):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-6)
    # and the adapters are on again after it: the policy's logprobs differ from the base's
    policy = b.compute_logprobs(SAMPLES)
    gaps = [
        abs(x - y) for p, e in zip(policy, expected, strict=True) for x, y in zip(p, e, strict=True)
    ]
    assert max(gaps) > 1e-3


def test_merged_weights_equal_peft_merge_and_unload(tiny_qwen2):
    model = lora_model(tiny_qwen2)
    merged = dict(lora_backend(model).named_weights())
    expected = lora_model(tiny_qwen2).merge_and_unload().state_dict()
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.allclose(merged[name], tensor, atol=1e-6), name
    # the merge is not the base: the scale 8 / 4 = 2 times B A moved q_proj
    base = tiny_qwen2(0).state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (merged[q] - base[q]).abs().max() > 1e-3


def test_adapter_sync_bytes_by_hand_on_the_tiny_model(tiny_qwen2):
    """fp32, 4 bytes: the adapters 4 x 4096 = 16,384 bytes. The full sync (tied: embedding and
    lm_head both sent, 64 x 32 = 2048 each); per layer q 32x32+32 = 1056, k, v 16x32+16 = 528
    each, o 1024, MLP 3 x 32x64 = 6144, two norms 64: 9344; final norm 32:
    4096 + 2 x 9344 + 32 = 22,816 floats = 91,264 bytes (5.6x: a model this small is mostly
    the adapters' size; the 10x checks are on the real shapes below)."""
    model = lora.apply_lora(tiny_qwen2(0), LoraConfig(r=4))
    assert lora.adapter_bytes(lora.adapter_weights(model.state_dict())) == 16_384
    assert lora.adapter_bytes(lora.engine_weights(model)) == 91_264


def _shape_bytes(r: int, **geometry) -> tuple[int, int]:
    """(adapter bytes, full-sync bytes) of a Qwen2 of ``geometry`` with rank-``r`` adapters on
    the 7 projections, built on the meta device (no memory)."""
    from conftest import tiny_qwen2_config
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(tiny_qwen2_config(**geometry))
    model = lora.apply_lora(model, LoraConfig(r=r))
    state = model.state_dict()
    return lora.adapter_bytes(lora.adapter_weights(state)), lora.adapter_bytes(
        lora.merged_weights(state, 1.0)
    )


def test_adapter_sync_ten_times_smaller_default_task_model_at_r8():
    """The default task's model (hidden 128, MLP 384, 4 heads of 32, 2 KV heads: k, v
    128 -> 64; 2 layers; vocab 400, tied) at r 8. Adapters per layer, r (in + out): q, o
    8 x 256 = 2048 each; k, v 8 x 192 = 1536 each; gate, up, down 8 x 512 = 4096 each: 19,456
    x 2 layers = 38,912 floats = 155,648 bytes. Full: embedding and lm_head 400 x 128 = 51,200
    each; per layer q 16,384 + 128, k, v 8,192 + 64 each, o 16,384, MLP 3 x 49,152, norms 256:
    197,120; final norm 128: 102,400 + 394,240 + 128 = 496,768 floats = 1,987,072 bytes; 12.8x.
    (At r 16 it is 6.4x: the tiny model is barely bigger than its adapters. The run's trained
    BPE ended at 312 tokens, not 400: 1,896,960 / 155,648 = 12.2x there.)"""
    geometry = dict(
        vocab_size=400,
        hidden_size=128,
        intermediate_size=384,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    adapter, full = _shape_bytes(8, **geometry)
    assert (adapter, full) == (155_648, 1_987_072)
    assert full / adapter >= 10


def test_adapter_sync_ten_times_smaller_qwen25_05b_shape_at_r16():
    """Qwen2.5-0.5B's shape (hidden 896, MLP 4864, 24 layers, 14 heads of 64, 2 KV heads: k, v
    896 -> 128; vocab 151,936, tied) at r 16. Adapters per layer: q, o 16 x 1792 = 28,672 each;
    k, v 16 x 1024 = 16,384 each; gate, up, down 16 x 5760 = 92,160 each: 366,592 x 24 =
    8,798,208 floats = 35,192,832 bytes. Full: 494,032,768 parameters + the tied lm_head
    (136,134,656) sent under its own name = 630,167,424 floats = 2,520,669,696 bytes: 71.6x."""
    geometry = dict(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    )
    adapter, full = _shape_bytes(16, **geometry)
    assert adapter == 35_192_832
    assert full == 2_520_669_696
    assert full / adapter > 70


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.lora.dropout=1"], "model.lora.dropout: must be below 1"),
        (["model.lora.alpha=0"], "model.lora.alpha: must be positive"),
        (["model.lora.r=-1"], "model.lora.r: must be at least 0"),
        (["model.lora.r=8", "model.lora.target_modules=all"], "model.lora.target_modules='all'"),
        (
            ["model.lora.r=8", "model.lora.sync=adapter", "rollout.engine=hf"],
            "model.lora.sync=adapter: only rollout.engine=vllm",
        ),
        (
            ["model.lora.r=8", "placement.mode=colocated"],
            "model.lora.r=8: LoRA runs with placement.mode=single only",
        ),
        (
            ["model.lora.r=8", "trainer.backend=deepspeed", "trainer.deepspeed.zero_stage=3"],
            "model.lora.r=8: LoRA under ZeRO-3",
        ),
        (
            ["model.lora.r=8", "trainer.backend=megatron"],
            "model.lora.r=8: LoRA runs on trainer.backend=torch or deepspeed, not megatron",
        ),
    ],
)
def test_bad_lora_settings_are_refused_by_their_key(overrides, message):
    from treadle.config import load_config

    with pytest.raises(UserError, match=f"^config {re.escape(message)}"):
        load_config(None, overrides)


def test_lora_off_by_default_and_all_linear_accepted():
    from treadle.config import load_config

    assert load_config(None, []).model.lora.r == 0
    cfg = load_config(None, ["model.lora.r=8", "model.lora.target_modules=all-linear"])
    assert cfg.model.lora.target_modules == "all-linear"


def test_the_lora_recipe_is_the_default_run_with_rank_8_adapters():
    from pathlib import Path

    from treadle.config import load_config

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    cfg, default = load_config(recipes / "lora.yaml"), load_config(recipes / "default.yaml")
    assert (cfg.model.lora.r, cfg.model.lora.alpha, cfg.trainer.lr) == (8, 16.0, 1e-3)
    assert cfg.sft == default.sft and cfg.data == default.data


def test_sft_with_lora_sft_trains_adapters_and_exports_the_merged_model(tiny_qwen2, tmp_path):
    from transformers import AutoModelForCausalLM

    from treadle.config import load_config
    from treadle.jobs.sft import sft_backend

    cfg = load_config(None, ["model.lora.r=4", "model.lora.sft=true"])
    backend = sft_backend(cfg, tiny_qwen2(0), 2)
    assert lora.is_lora(backend.model)
    backend.train_step(SAMPLES, SFTObjective())
    lora.exported(backend).save_pretrained(tmp_path / "sft_model")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "sft_model").state_dict()
    merged = dict(backend.named_weights())
    assert saved.keys() == merged.keys()
    assert all(torch.equal(saved[n], merged[n]) for n in saved)
    assert (tmp_path / "sft_model" / "adapter" / "adapter_config.json").is_file()
    # without model.lora.sft the warm-up trains every weight
    plain = sft_backend(load_config(None, ["model.lora.r=4"]), tiny_qwen2(0), 2)
    assert not lora.is_lora(plain.model)
