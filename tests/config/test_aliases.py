"""Tests for treadle.config.aliases: TRL's and verl's names for treadle's keys in the "did you
mean" of an unknown key, and the old name ``model.dtype``."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from treadle.config import load_config
from treadle.config.aliases import ALIASES, hint
from treadle.config.keys import config_keys
from treadle.core.errors import UserError

DEFAULT = Path(__file__).resolve().parents[2] / "recipes" / "default.yaml"
KEYS = {r.key for r in config_keys()}


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_every_alias_names_a_real_key_and_is_not_one(name):
    alias = ALIASES[name]
    assert alias.key is None or alias.key in KEYS, f"{name} -> {alias.key}: no such key"
    assert alias.key is not None or alias.note, f"{name}: no key, so the note must say why"
    # An alias never shadows a key: it is only looked up for a key that does not exist. (A bare
    # name may equal a key's last part, ``temperature``: written at the root, or in another
    # section, it still points to the one key.)
    assert name not in KEYS


@pytest.mark.parametrize(
    ("override", "says"),
    [
        (
            "trainer.learning_rate=1e-5",
            "unknown key trainer.learning_rate; did you mean trainer.lr?",
        ),
        ("learning_rate=1e-5", "unknown key learning_rate; did you mean trainer.lr?"),
        ("rollout.num_generations=4", "did you mean rollout.n? (num_generations is TRL's name)"),
        ("algorithm.beta=0.04", "did you mean algorithm.kl.coef? (beta is TRL's name)"),
        ("trainer.ppo_epochs=2", "did you mean trainer.mini_batches? (ppo_epochs is verl's name;"),
        ("algorithm.epsilon=0.2", "did you mean algorithm.clip_eps_low?"),
        ("trainer.max_grad_norm=1", "did you mean trainer.grad_clip?"),
        ("data.train_batch_size=32", "did you mean rollout.prompts_per_step?"),
        # verl's whole path under a section treadle does not have.
        (
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "unknown key actor_rollout_ref.actor.optim.lr; "
            "did you mean trainer.lr? (actor_rollout_ref.actor.optim.lr is verl's name)",
        ),
        ("actor_rollout_ref.rollout.n=5", "did you mean rollout.n?"),
        ("data.max_prompt_length=512", "max_prompt_length is TRL and verl's name, treadle has no"),
        # A near spelling of the section's own key wins over an alias: betas, not KL's beta.
        ("trainer.beta=0.9", "unknown key trainer.beta; did you mean trainer.betas?"),
        ("trainer.lrr=1", "unknown key trainer.lrr; did you mean trainer.lr?"),
    ],
)
def test_unknown_keys_suggest_treadles_name_in_one_line(override, says):
    with pytest.raises(UserError) as e:
        load_config(DEFAULT, [override])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_hint_of_a_name_without_an_alias_is_none():
    assert hint("trainer.lrr") is None and hint("xyzzy") is None


def test_old_model_dtype_loads_as_rollout_dtype_with_one_warning(caplog, tmp_path):
    with caplog.at_level(logging.WARNING, "treadle.config.loading"):
        cfg = load_config(DEFAULT, ["model.dtype=bfloat16"])
    assert cfg.rollout.dtype == "bfloat16"
    (record,) = caplog.records
    assert (
        "model.dtype is deprecated" in record.getMessage()
        and "rollout.dtype" in record.getMessage()
    )
    # An old run's config.yaml (a file, not an override) loads the same way.
    old = tmp_path / "config.yaml"
    old.write_text(f"base: {DEFAULT}\nmodel: {{dtype: bfloat16}}\n")
    assert load_config(old).rollout.dtype == "bfloat16"
    with pytest.raises(UserError, match=re.escape("give only rollout.dtype")):
        load_config(DEFAULT, ["model.dtype=bfloat16", "rollout.dtype=float32"])


def test_chat_template_kwargs_load_typed():
    cfg = load_config(DEFAULT, ["data.chat_template_kwargs={enable_thinking: false}"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    assert load_config(DEFAULT).data.chat_template_kwargs == {}
