"""Tests for the one-field bounds declared beside the config's fields, and for the data sources
(``data`` and ``data.mix[i]``) that share their fields."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from treadle.config import Config, DataConfig, MixConfig, load_config, to_dict
from treadle.config.fields import rules_of
from treadle.core.errors import UserError

RECIPES = Path(__file__).resolve().parents[2] / "recipes"

# Every "at least" bound of the config: the table the cross-field check held before the bounds
# moved beside their fields (an int bound reads "1", a float one "0.0").
AT_LEAST = {
    "run.steps": 0, "run.save_every": 1, "run.keep_last": 2,
    "data.size": 1, "data.eval_size": 1,
    "sft.steps": 0, "sft.batch_size": 1,
    "rollout.prompts_per_step": 1, "rollout.n": 1, "rollout.max_tokens": 1,
    "rollout.max_staleness": 0, "rollout.oversample": 0, "rollout.kv_cache_gib": 0.0,
    "algorithm.clip_eps_low": 0.0, "algorithm.clip_eps_high": 0.0, "algorithm.dual_clip": 0.0,
    "algorithm.kl.coef": 0.0, "algorithm.entropy_coef": 0.0, "algorithm.gamma": 0.0,
    "algorithm.lam": 0.0, "algorithm.max_sampling_rounds": 1, "algorithm.overlong_cache": 0,
    "algorithm.critic.value_clip": 0.0, "algorithm.off_policy_mask": 0.0,
    "algorithm.mismatch.max_kl_k3": 0.0, "algorithm.mismatch.max_abs_logprob_diff": 0.0,
    "trainer.weight_decay": 0.0, "trainer.grad_clip": 0.0, "trainer.warmup_steps": 0,
    "trainer.micro_batch_tokens": 16, "trainer.mini_batches": 1, "trainer.peak_tflops": 0.0,
    "eval.every": 0, "eval.samples_per_prompt": 1,
    "dpo.steps": 1, "dpo.batch_size": 1,
    "placement.trainers": 1, "placement.engines": 1, "placement.trainer_cpus": 0.0,
    "placement.engine_cpus": 0.0, "placement.trainer_gpus": 0.0, "placement.engine_gpus": 0.0,
    "placement.threads": 1, "placement.bucket_mb": 1, "placement.engine_restarts": 0,
    # Bounds added with the move (each was a traceback or a silent nonsense run before):
    "run.threads": 1, "reward.workers": 0,
    "model.tiny.hidden_size": 1, "model.tiny.intermediate_size": 1,
    "model.tiny.num_hidden_layers": 1, "model.tiny.max_position_embeddings": 1,
    "sft.noise.loose_format_fraction": 0.0, "sft.noise.wrong_answer_fraction": 0.0,
    "environment.max_turns": 1, "environment.max_tokens": 1,
    "environment.max_observation_tokens": 1, "environment.max_concurrent": 1,
    "environment.tool_threads": 1,
    "rollout.tensor_parallel": 1, "rollout.max_running": 0,
    "trainer.megatron.tensor_parallel": 1, "trainer.megatron.pipeline_parallel": 1,
    "model.lora.r": 0, "model.lora.dropout": 0.0,
}  # fmt: skip

# What a key needs beside it to load at all (loads below start from no recipe).
COMPANIONS = {
    "rollout.n": ["algorithm.advantage=reinforce_pp"],  # one sample: no group baseline
    "model.tiny.hidden_size": [
        "model.tiny.num_attention_heads=1", "model.tiny.num_key_value_heads=1", "rollout.engine=hf"
    ],
    "reward.workers": ["reward.functions=[{name: reasoning_gym}]"],
}  # fmt: skip


def declared_rules(node, path: str = "") -> dict[str, list[str]]:
    """Dotted key -> what its rules say, for every field of ``node``'s tree that has rules."""
    found = {}
    for f in dataclasses.fields(node):
        key = f"{path}.{f.name}" if path else f.name
        if rules_of(f):
            found[key] = [r.says for r in rules_of(f)]
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            found |= declared_rules(value, key)
    return found


def test_the_at_least_bounds_are_declared_on_exactly_these_fields():
    declared = {
        key: says[0]
        for key, says in declared_rules(Config()).items()
        if says[0].startswith("must be at least")
    }
    assert declared == {k: f"must be at least {v} (and finite)" for k, v in AT_LEAST.items()}


@pytest.mark.parametrize(("key", "least"), AT_LEAST.items())
def test_a_value_below_its_bound_is_refused_by_its_dotted_name(key, least):
    below = least - 1
    expected = f"config {key}: must be at least {least} (and finite), got {below}"
    with pytest.raises(UserError, match=f"^{re.escape(expected)}$"):
        load_config(None, [f"{key}={below}", *COMPANIONS.get(key, [])])
    if isinstance(least, float):  # nan compares false with every bound: refused too
        with pytest.raises(UserError, match=re.escape(f"config {key}: must be at least")):
            load_config(None, [f"{key}=.nan", *COMPANIONS.get(key, [])])


@pytest.mark.parametrize(("key", "least"), AT_LEAST.items())
def test_the_bound_itself_is_accepted(key, least):
    cfg = to_dict(load_config(None, [f"{key}={least}", *COMPANIONS.get(key, [])]))
    section, *rest = key.split(".")
    node = cfg[section]
    for part in rest:
        node = node[part]
    assert node == least and type(node) is type(least)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.temperature=0", "rollout.temperature: must be positive"),
        ("rollout.temperature=.inf", "rollout.temperature: must be a finite number, got inf"),
        ("rollout.top_p=0.9", "rollout.top_p: only 1.0 is supported"),
        ("trainer.lr=0", "trainer.lr: must be positive, got 0.0"),
        ("sft.lr=-1", "sft.lr: must be positive, got -1.0"),
        ("dpo.lr=.inf", "dpo.lr: must be a finite number, got inf"),
        ("dpo.beta=0", "dpo.beta: must be positive (e.g. 0.1), got 0.0"),
        ("algorithm.clip_eps_low=1", "algorithm.clip_eps_low: must be below 1"),
        ("algorithm.dual_clip=1", "algorithm.dual_clip: must be above 1 (or 0 for off)"),
        ("algorithm.gamma=1.5", "algorithm.gamma: must be at most 1, got 1.5"),
        ("algorithm.lam=1.01", "algorithm.lam: must be at most 1, got 1.01"),
        ("algorithm.is_threshold=1", "algorithm.is_threshold: must be above 1, got 1.0"),
        ("algorithm.is_threshold=.inf", "algorithm.is_threshold: must be a finite number"),
        ("algorithm.critic.lr=0", "algorithm.critic.lr: must be positive, got 0.0"),
        ("algorithm.mismatch.max_kl_k3=.inf", "algorithm.mismatch.max_kl_k3: must be at least"),
        (
            "algorithm.mismatch.max_abs_logprob_diff=-0.5",
            "algorithm.mismatch.max_abs_logprob_diff: must be at least 0.0 (and finite), got -0.5",
        ),
        ("data.weight=0", "data.weight: must be positive, got 0.0"),
        ("data.weight=.inf", "data.weight: must be a finite number, got inf"),
        ("trainer.lr=.inf", "trainer.lr: must be a finite number, got inf"),
        ("sft.lr=.inf", "sft.lr: must be a finite number, got inf"),
        ("run.threads=0", "run.threads: must be at least 1 (and finite), got 0"),
        ("model.tiny.hidden_size=0", "model.tiny.hidden_size: must be at least 1 (and finite)"),
        ("sft.noise.loose_format_fraction=2", "sft.noise.loose_format_fraction: must be at most 1"),
    ],
)
def test_other_one_field_rules_name_their_key(override, message):
    with pytest.raises(UserError, match=f"^config {re.escape(message)}"):
        load_config(None, [override])


def test_values_at_the_edges_of_the_other_rules_are_accepted():
    cfg = load_config(None, ["algorithm.dual_clip=0", "algorithm.gamma=1", "algorithm.lam=0",
                             "algorithm.is_threshold=1.01"])  # fmt: skip
    a = cfg.algorithm
    assert (a.dual_clip, a.gamma, a.lam, a.is_threshold) == (0.0, 1.0, 0.0, 1.01)


def test_a_mixed_source_is_refused_by_its_index_in_the_list():
    mix = "data.mix=[{source: reasoning_gym, domain: a, weight: 1}, {source: reasoning_gym, " \
          "domain: b, weight: 0}]"  # fmt: skip
    with pytest.raises(UserError, match=r"^config data\.mix\[1\]\.weight: must be positive"):
        load_config(RECIPES / "mixed.yaml", [mix])


def test_a_mixed_source_may_hold_out_nothing():
    mix = "data.mix=[{source: reasoning_gym, domain: a, weight: 1, eval_size: 0}]"
    assert load_config(None, [mix]).data.mix[0].eval_size == 0


def test_data_and_mix_keep_their_defaults_and_required_keys():
    d = DataConfig()
    assert (d.source, d.domain, d.eval_size, d.weight, d.size) == (
        "reasoning_gym", "math", 100, 1.0, 2000
    )  # fmt: skip
    m = MixConfig(source="jsonl", path="x.jsonl", domain="math", weight=0.5)
    assert (m.eval_size, m.size, m.task, m.task_params) == (50, 2000, "chain_sum", {})
    with pytest.raises(UserError, match=re.escape(
        "missing required key data.mix[0].source, data.mix[0].domain, data.mix[0].weight"
    )):  # fmt: skip
        load_config(None, ["data.mix=[{path: x.jsonl}]"])


def test_the_mixed_recipe_loads_its_sources_as_written():
    cfg = load_config(RECIPES / "mixed.yaml")
    assert (cfg.data.source, cfg.data.domain, cfg.data.weight) == ("reasoning_gym", "arith", 2.0)
    gsm8k, mbpp = cfg.data.mix
    assert type(gsm8k) is MixConfig
    assert (gsm8k.source, gsm8k.domain, gsm8k.weight, gsm8k.size, gsm8k.eval_size) == (
        "jsonl", "math", 1.0, 2000, 50
    )  # fmt: skip
    assert gsm8k.answer_pattern == r"####\s*(.+)$" and gsm8k.question_field == "question"
    assert (mbpp.source, mbpp.domain, mbpp.size, mbpp.path) == (
        "mbpp", "code", 350, "../shared/data/mbpp/sanitized-mbpp.json"
    )  # fmt: skip


def test_a_config_yaml_written_with_the_earlier_key_order_loads(tmp_path):
    # Before the shared source fields, config.yaml listed data's keys in this order.
    cfg = load_config(RECIPES / "mixed.yaml")
    data = to_dict(cfg)["data"]
    earlier = ["source", "path", "question_field", "answer_field", "answer_pattern", "task",
               "task_params", "size", "seed", "domain", "eval_size", "system_prompt",
               "answer_template", "reasoning", "weight", "mix"]  # fmt: skip
    mix_earlier = ["source", "weight", "domain", "path", "question_field", "answer_field",
                   "answer_pattern", "task", "task_params", "size", "eval_size"]  # fmt: skip
    # Keys added since (data.chat_template_kwargs, ...) are absent from such a file: defaults.
    assert set(earlier) <= set(data) and set(mix_earlier) <= set(data["mix"][0])
    written = {**to_dict(cfg), "data": {k: data[k] for k in earlier}}
    written["data"]["mix"] = [{k: m[k] for k in mix_earlier} for m in data["mix"]]
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(written, sort_keys=False))
    assert load_config(saved) == cfg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("reward.timeout_s=-1", "reward.timeout_s: must be positive, got -1.0"),
        ("reward.timeout_s=.nan", "reward.timeout_s: must be positive, got nan"),
        ("reward.step_timeout_s=0", "reward.step_timeout_s: must be positive, got 0.0"),
        ("reward.step_timeout_s=.inf", "reward.step_timeout_s: must be a finite number, got inf"),
        ("reward.fallback=.nan", "reward.fallback: must be a finite number, got nan"),
        ("reward.functions=[{name: math_verify, weight: .nan}]",
         "reward.functions[0].weight: must be a finite number, got nan"),
    ],
)  # fmt: skip
def test_reward_settings_are_refused_at_load_not_after_the_warm_up(override, message):
    # Before, the pool refused these only when it was built, after the SFT warm-up (or not at
    # all: a nan timeout or fallback ran).
    with pytest.raises(UserError, match=f"^config {re.escape(message)}"):
        load_config(RECIPES / "default.yaml", [override])
