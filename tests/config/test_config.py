"""Tests for treadle.config: recipe loading, dotted overrides, and the errors bad input gets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from treadle.config import Config, RunConfig, load_config, to_dict
from treadle.core.errors import UserError

DEFAULT = Path(__file__).resolve().parents[2] / "recipes" / "default.yaml"


RECIPE = yaml.safe_load(DEFAULT.read_text())


def assert_written_values_kept(written, built, path: str = "") -> None:
    """Every leaf written in the recipe has the same value at the same path in ``built``."""
    if isinstance(written, dict):
        for key, value in written.items():
            assert key in built, f"{path}.{key} missing"
            assert_written_values_kept(value, built[key], f"{path}.{key}")
    elif isinstance(written, list):
        assert len(built) == len(written), path
        for i, (w, b) in enumerate(zip(written, built, strict=True)):
            assert_written_values_kept(w, b, f"{path}[{i}]")
    else:
        assert built == written, path
        assert type(built) is type(written), path


def test_default_recipe_values_reach_the_tree():
    cfg = load_config(DEFAULT)
    assert_written_values_kept(RECIPE, to_dict(cfg))
    # The recipe is applied, not ignored: it sets values that differ from the dataclass defaults.
    assert RECIPE["run"]["steps"] != RunConfig().steps == 20
    assert cfg.run.steps == RECIPE["run"]["steps"]
    # "3.0e-3" (with a dot) is a YAML float; a YAML list becomes the declared tuple.
    assert cfg.sft.lr == 3.0e-3 and type(cfg.sft.lr) is float
    assert cfg.trainer.betas == (0.9, 0.99)
    # Keys the recipe leaves out keep the dataclass defaults; spec fields get theirs too.
    assert "lr_schedule" not in RECIPE["trainer"] and cfg.trainer.lr_schedule == "constant"
    assert cfg.reward.functions[0].weight == 1.0 and cfg.reward.functions[0].params == {}


def test_float_override_written_in_exponent_form_is_a_float():
    # YAML 1.1 reads "1e-5" (no dot) as a string; the loader must still produce the float.
    cfg = load_config(DEFAULT, ["trainer.lr=1e-5"])
    assert cfg.trainer.lr == 1e-5
    assert type(cfg.trainer.lr) is float


def test_override_into_a_dict_section_merges_with_the_recipe():
    written = RECIPE["data"]["task_params"]
    assert written["max_digits"] != 3 and "max_terms" in written
    cfg = load_config(DEFAULT, ["data.task_params.max_digits=3", "rollout.n=4"])
    # max_digits replaced, every other task param of the recipe kept.
    assert cfg.data.task_params == {**written, "max_digits": 3}
    assert type(cfg.data.task_params["max_digits"]) is int
    assert cfg.rollout.n == 4
    cfg = load_config(DEFAULT, ["data.task_params.max_digits=1"])
    assert cfg.data.task_params == {**written, "max_digits": 1}


def test_override_without_recipe_builds_on_defaults():
    cfg = load_config(None, ["run.name=x", "model.path=null"])
    assert cfg.run.name == "x" and cfg.model.path is None
    assert cfg.trainer == Config().trainer


def test_unknown_key_names_dotted_path_and_suggests_the_closest():
    with pytest.raises(UserError) as e:
        load_config(DEFAULT, ["trainer.lrr=1e-5"])
    msg = str(e.value)
    assert "trainer.lrr" in msg
    assert "did you mean trainer.lr?" in msg


def test_unknown_top_level_and_nested_keys_get_suggestions():
    with pytest.raises(UserError, match=r"unknown key trainr; did you mean trainer\?"):
        load_config(DEFAULT, ["trainr.lr=1"])
    with pytest.raises(UserError, match=r"did you mean sft\.noise\.loose_format_fraction\?"):
        load_config(DEFAULT, ["sft.noise.loose_fraction=0.1"])


def test_wrong_type_names_path_and_expected_type():
    with pytest.raises(UserError) as e:
        load_config(DEFAULT, ["rollout.n=abc"])
    msg = str(e.value)
    assert "rollout.n" in msg and "int" in msg and "'abc'" in msg


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.n=2.0", "rollout.n: expected int"),  # no silent float -> int truncation
        ("trainer.bf16_autocast=1", "trainer.bf16_autocast: expected bool"),
        ("trainer.lr=true", "trainer.lr: expected float"),  # bool is not a number here
        ("trainer.betas=[0.9]", "trainer.betas: expected a list of 2 values"),
    ],
)
def test_near_miss_types_are_rejected(override, expected):
    with pytest.raises(UserError, match=re.escape(expected)):
        load_config(DEFAULT, [override])


def test_literal_violation_lists_the_choices():
    with pytest.raises(UserError) as e:
        load_config(DEFAULT, ["rollout.engine=tensorrt"])
    msg = str(e.value)
    assert "rollout.engine" in msg and "'vllm'" in msg and "'hf'" in msg and "'sglang'" in msg
    assert "'tensorrt'" in msg


def test_the_mismatch_alarm_section_loads_and_refuses_an_unknown_action():
    m = load_config(DEFAULT, []).algorithm.mismatch
    assert (m.max_kl_k3, m.max_abs_logprob_diff, m.action) == (0.01, 10.0, "warn")
    keys = ["action=stop", "max_kl_k3=0.05", "max_abs_logprob_diff=0"]
    m = load_config(DEFAULT, [f"algorithm.mismatch.{k}" for k in keys]).algorithm.mismatch
    assert (m.max_kl_k3, m.max_abs_logprob_diff, m.action) == (0.05, 0.0, "stop")
    with pytest.raises(UserError) as e:
        load_config(DEFAULT, ["algorithm.mismatch.action=raise"])
    msg = str(e.value)
    assert "algorithm.mismatch.action" in msg and "'warn'" in msg and "'stop'" in msg
    unknown = (
        "config: unknown key algorithm.mismatch.max_kl_k; "
        "did you mean algorithm.mismatch.max_kl_k3?"
    )
    with pytest.raises(UserError, match=f"^{re.escape(unknown)}"):
        load_config(DEFAULT, ["algorithm.mismatch.max_kl_k=0.1"])


def test_yaml_list_where_a_section_is_expected(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  - lr\n  - 1.0e-4\n")
    with pytest.raises(UserError, match=r"config trainer: expected a section \(mapping\)"):
        load_config(recipe)


def test_recipe_that_is_not_a_mapping(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("- run\n- model\n")
    with pytest.raises(UserError, match="must be a mapping of sections"):
        load_config(recipe)


def test_override_below_a_value_is_rejected():
    # trainer.lr is a number in the recipe; it cannot hold a sub-key.
    with pytest.raises(UserError, match=re.escape("override trainer.lr.x: lr is a value")):
        load_config(DEFAULT, ["trainer.lr.x=1"])


def test_malformed_override():
    with pytest.raises(UserError, match=re.escape("must look like section.key=value")):
        load_config(DEFAULT, ["trainer.lr"])


def test_missing_recipe_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(UserError) as e:
        load_config(missing)
    assert str(missing) in str(e.value) and "does not exist" in str(e.value)


def test_invalid_yaml_recipe(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("run: {name: [unclosed\n")
    with pytest.raises(UserError, match="is not valid YAML") as e:
        load_config(recipe)
    assert "\n" not in str(e.value)  # yaml's several lines, as one


def test_a_recipe_that_is_not_utf8_is_refused_naming_the_byte(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_bytes(b"run:\n  name: \xff\n")  # 5 + 8 bytes before the 0xff: byte 13
    with pytest.raises(
        UserError, match=r"bad.yaml is not UTF-8 text \(byte 13: invalid start byte\)"
    ):
        load_config(recipe)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("rollout.n=1", "rollout.n"),  # GRPO needs a group of at least 2
        ("trainer.lr=0", "trainer.lr"),
        ("trainer.micro_batch_tokens=8", "trainer.micro_batch_tokens"),
        ("reward.functions=[]", "reward.functions"),
    ],
)
def test_cross_field_checks_name_the_key(override, key):
    with pytest.raises(UserError, match=re.escape(key)):
        load_config(DEFAULT, [override])


def test_file_source_requires_a_path():
    with pytest.raises(UserError, match=re.escape("data.path: required for source=jsonl")):
        load_config(DEFAULT, ["data.source=jsonl", "reward.functions=[{name: math_verify}]"])


def test_reasoning_gym_reward_on_file_data_is_rejected():
    with pytest.raises(UserError, match="use math_verify"):
        load_config(DEFAULT, ["data.source=jsonl", "data.path=x.jsonl", "data.reasoning=none"])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("rollout.top_p=0.9", "rollout.top_p"),
        ("trainer.grad_clip=-1", "trainer.grad_clip"),
        ("trainer.lr=.nan", "trainer.lr"),
        ("algorithm.kl.coef=-0.1", "algorithm.kl.coef"),
        ("model.tiny.num_attention_heads=8", "head dim"),  # 128 / 8 = 16 < 32 for vLLM
        ("model.tiny.num_key_value_heads=3", "model.tiny.num_key_value_heads"),  # 4 % 3 != 0
        ("rollout.temperature=0", "rollout.temperature"),
    ],
)
def test_values_that_would_fail_deep_in_torch_or_vllm_are_rejected(override, key):
    with pytest.raises(UserError, match=re.escape(key)):
        load_config(DEFAULT, [override])


def test_resolved_config_round_trips_through_yaml(tmp_path):
    # The run directory's config.yaml is what --resume loads: it must rebuild the same tree.
    cfg = load_config(DEFAULT, ["trainer.lr=1e-5", "data.task_params.max_digits=1"])
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    assert load_config(saved) == cfg


@pytest.mark.parametrize("override", ["reward.timeout_s=3", "reward.functions=[{weight: 1}]"])
def test_section_missing_a_required_field_is_a_user_error(override):
    with pytest.raises(UserError, match="reward"):
        load_config(None, [override])


@pytest.mark.parametrize(
    "override",
    ["data.answer_template=<answer>{ans}</answer>", "sft.noise.loose_template=The answer is {ans}"],
)
def test_template_with_an_unknown_field_is_rejected_at_load(override):
    with pytest.raises(UserError, match=re.escape(override.split("=")[0])):
        load_config(DEFAULT, [override])


@pytest.mark.parametrize(
    ("key", "text"),
    [
        ("sft.noise.loose_template", "{answer}"),  # the dataclass default, written out
        ("data.answer_template", "{reasoning} <answer>{answer}</answer>"),  # as in the recipe
    ],
)
def test_string_override_that_looks_like_yaml_flow_syntax(key, text):
    cfg = to_dict(load_config(DEFAULT, [f"{key}={text}"]))
    section, *rest = key.split(".")
    node = cfg[section]
    for part in rest:
        node = node[part]
    assert node == text


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("algorithm.clip_eps_low=.nan", "algorithm.clip_eps_low"),
        ("algorithm.gamma=.nan", "algorithm.gamma"),
        ("algorithm.kl.coef=.nan", "algorithm.kl.coef"),
        ("algorithm.is_threshold=.nan", "algorithm.is_threshold"),
        ("algorithm.critic.value_clip=.inf", "algorithm.critic.value_clip"),
        ("dpo.beta=.inf", "dpo.beta"),
    ],
)
def test_nan_and_inf_are_refused_by_name(override, key):
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_k1_is_refused_as_a_kl_loss_term():
    with pytest.raises(UserError, match="k1 as a loss term"):
        load_config(None, ["algorithm.kl.coef=0.1", "algorithm.kl.estimator=k1"])
    cfg = load_config(None, ["algorithm.kl.coef=0.1", "algorithm.kl.estimator=k1",
                             "algorithm.kl.placement=reward"])  # fmt: skip
    assert cfg.algorithm.kl.placement == "reward"


def test_dynamic_sampling_needs_a_group_baseline():
    with pytest.raises(UserError, match="dynamic_sampling"):
        load_config(None, ["algorithm.dynamic_sampling=true", "algorithm.advantage=reinforce_pp"])


def test_group_baselines_refuse_one_sample_per_prompt():
    for advantage in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        with pytest.raises(UserError, match=r"rollout\.n"):
            load_config(None, [f"algorithm.advantage={advantage}", "rollout.n=1"])
    for advantage in ("reinforce_pp", "remax", "gae"):
        assert load_config(None, [f"algorithm.advantage={advantage}", "rollout.n=1"]).rollout.n == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.partial=true"], r"rollout\.partial: has no effect with rollout\.mode=sync"),
        (["rollout.oversample=2"], r"rollout\.oversample: has no effect with rollout\.mode=sync"),
        (["rollout.max_running=64"], r"rollout\.max_running: has no effect with rollout\.mode="),
        (
            ["rollout.mode=async", "rollout.engine_process=own", "placement.mode=disaggregated"],
            r"rollout\.engine_process=own: placement\.mode=disaggregated runs every engine",
        ),
        (
            ["rollout.mode=async", "rollout.engine_process=own", "rollout.tensor_parallel=2"],
            r"rollout\.engine_process=own: vLLM's tensor-parallel ranks",
        ),
        (["rollout.engine_process=elsewhere"], r"rollout\.engine_process"),
        (["rollout.mode=one_step_off", "rollout.partial=true"], r"use rollout\.mode=async"),
        (["rollout.mode=async", "algorithm.advantage=remax"], r"ReMax's greedy baseline"),
        (["rollout.mode=async", "rollout.max_staleness=-1"], r"rollout\.max_staleness"),
        (["rollout.mode=fast"], r"rollout\.mode"),
        (
            ["rollout.mode=async", "rollout.partial=true", "rollout.stop=[</answer>]"],
            r"rollout\.partial: .* a stop string split at the abort",
        ),
    ],
)
def test_rollout_modes_refuse_what_they_do_not_do(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


def test_the_asynchronous_modes_load_with_their_settings_and_ray_placement():
    cfg = load_config(None, ["rollout.mode=async", "rollout.max_staleness=4",
                             "rollout.partial=true", "rollout.oversample=8",
                             "placement.mode=disaggregated"])  # fmt: skip
    r = cfg.rollout
    assert (r.mode, r.max_staleness, r.partial, r.oversample) == ("async", 4, True, 8)


def test_reward_params_keep_their_yaml_types(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "reward:\n  functions:\n    - name: code\n      params:\n"
        "        timeout_s: 2.5\n        memory_mb: 256\n        strict: true\n"
        '        mode: all\n        tags: [a, 1, false]\n        old: "10"\n'
    )
    params = load_config(recipe).reward.functions[0].params
    # each value keeps its own type; a quoted "10" (older recipes) stays a string
    assert params == {
        "timeout_s": 2.5,
        "memory_mb": 256,
        "strict": True,
        "mode": "all",
        "tags": ["a", 1, False],
        "old": "10",
    }
    assert [type(v) for v in params.values()] == [float, int, bool, str, list, str]
    override = "reward.functions=[{name: code, params: {memory_mb: 512, strict: false}}]"
    typed = load_config(None, [override]).reward.functions[0].params
    assert typed == {"memory_mb": 512, "strict": False} and type(typed["memory_mb"]) is int
    with pytest.raises(UserError, match=r"reward\.functions\[0\]\.params\.x"):
        load_config(None, ["reward.functions=[{name: code, params: {x: {nested: 1}}}]"])


def test_a_value_no_member_of_a_union_takes_names_the_members():
    # "data.source=mypkg:" is YAML for {'mypkg': None}; the error said "expected Union".
    with pytest.raises(UserError) as e:
        load_config(DEFAULT, ["data.source=mypkg:"])
    assert str(e.value) == (
        "config data.source: expected 'reasoning_gym' | 'jsonl' | 'parquet' | 'humaneval' | "
        "'mbpp' | str, got {'mypkg': None}"
    )


def test_an_override_steps_into_an_entry_of_a_list():
    # It was "unknown key reward.functions[0]": a reward's params could only be set by giving
    # the whole list again. The default recipe's list has one entry (reasoning_gym).
    cfg = load_config(
        DEFAULT,
        [
            "reward.functions[0].params.extract=boxed",
            "reward.functions[0].weight=2",
            "rollout.n=4",
        ],
    )
    (fn,) = cfg.reward.functions
    assert (fn.name, fn.params, fn.weight) == ("reasoning_gym", {"extract": "boxed"}, 2.0)
    # A list given earlier on the command line, then one of its entries: typed like the rest.
    cfg = load_config(
        DEFAULT,
        [
            "reward.functions=[{name: format}, {name: math_verify}]",
            "reward.functions[1].params.strict=true",
        ],
    )
    assert cfg.reward.functions[1].params == {"strict": True}
    with pytest.raises(UserError) as e:
        load_config(DEFAULT, ["reward.functions[1].weight=2"])
    assert str(e.value) == (
        "override reward.functions[1].weight: functions has 1 entries here, so no [1]; set the "
        "whole list, e.g. functions='[...]'"
    )
