"""Tests for treadle.config.keys: every key of the tree listed with its type, default and meaning
(what ``treadle config`` prints), and the names it accepts."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from treadle.config import Config, MixConfig
from treadle.config.keys import KeyDoc, config_keys, first_sentence, select_keys
from treadle.core.errors import UserError


def leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """The tree's leaf keys, walked here without treadle.config.keys: a section field recurses,
    a list of sections adds ``key[i]`` and its item's leaves."""
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out += leaf_keys(tp, key)
            continue
        out.append(key)
        args = typing.get_args(tp)
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(args[0]):
            out += leaf_keys(args[0], f"{key}[i]")
    return out


ROWS = {r.key: r for r in config_keys()}


def test_every_leaf_key_is_listed_once_with_a_meaning():
    expected = leaf_keys(Config)
    assert len(expected) > 140  # the tree as of writing: 144 leaves, lists included
    assert [r.key for r in config_keys()] == expected  # declaration order, no duplicates
    missing = [k for k in expected if not ROWS[k].meaning]
    assert missing == [], f"fields without a docstring: {missing}"


@pytest.mark.parametrize(
    ("key", "type_", "default"),
    [
        ("trainer.lr", "float", "0.0001"),  # 1e-4 written as YAML
        ("rollout.n", "int", "8"),
        ("rollout.mode", "sync|one_step_off|async", "sync"),
        ("rollout.dtype", "auto|float32|bfloat16", "float32"),
        ("trainer.betas", "tuple[float, float]", "[0.9, 0.99]"),
        ("model.path", "str | None", "null"),
        ("algorithm.kl.coef", "float", "0.0"),
        ("data.chat_template_kwargs", "dict[str, bool | int | float | str]", "{}"),
        # Config builds reward with one function: the list's default is that, not "required".
        (
            "reward.functions",
            "list[RewardSpec]",
            "[{domains: [], name: reasoning_gym, params: {}, weight: 1.0}]",
        ),
        ("reward.functions[i].name", "str", "required"),
        ("data.mix[i].weight", "float", "required"),
        ("data.mix[i].eval_size", "int", "50"),  # MixConfig's own default, not data's 100
        ("data.eval_size", "int", "100"),
        ("data.answer_template", "str", "'<answer>{answer}</answer>'"),
    ],
)
def test_hand_checked_types_and_defaults(key, type_, default):
    assert (ROWS[key].type, ROWS[key].default) == (type_, default)


def test_meaning_is_the_first_sentence_in_plain_text():
    # dpo.beta's docstring: "Strength of ... (beta of arXiv:2305.18290 eq. 7)." — "eq." goes on.
    assert ROWS["dpo.beta"].meaning.endswith("eq. 7).")
    # ``x`` markup becomes `x`; the first of two sentences is kept.
    assert ROWS["rollout.kv_cache_gib"].meaning.startswith("vLLM's KV-cache size (GiB, on CPU)")
    assert first_sentence("Seed, e.g. 3. Then more.") == "Seed, e.g. 3."
    assert ROWS["data.mix[i].size"].doc == ROWS["data.size"].doc  # inherited docstring
    # A redeclared field without its own docstring keeps its parent's.
    assert ROWS["data.eval_size"].meaning.startswith("Held-out prompts")


def test_select_a_section_a_subsection_a_key_and_an_index():
    rollout = select_keys("rollout")
    assert rollout and all(r.key.startswith("rollout.") for r in rollout)
    assert [r.key for r in select_keys("algorithm.kl")] == [
        "algorithm.kl.coef",
        "algorithm.kl.estimator",
        "algorithm.kl.placement",
    ]
    assert select_keys("rollout.n") == [ROWS["rollout.n"]]
    assert select_keys("data.mix[0].weight") == [ROWS["data.mix[i].weight"]]
    mix = [r.key for r in select_keys("data.mix")]
    assert mix[:2] == ["data.mix", "data.mix[i].source"]
    assert len(mix) == 1 + len(dataclasses.fields(MixConfig))
    assert len(select_keys(None)) == len(ROWS)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("rollot", "config: no section or key rollot; did you mean rollout?"),
        ("learning_rate", "did you mean trainer.lr? (learning_rate is TRL's name)"),
        ("xyzzy", "the sections are run, model, data,"),
    ],
)
def test_an_unknown_name_is_one_line_with_a_suggestion(name, says):
    with pytest.raises(UserError) as e:
        select_keys(name)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_keydoc_text_makes_rest_markup_plain():
    row = KeyDoc("a.b", "int", "1", "See :mod:`~treadle.x` and ``y``. More.")
    assert row.text == "See `treadle.x` and `y`. More."
    assert row.meaning == "See `treadle.x` and `y`."
