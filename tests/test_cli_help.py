"""The help that teaches, through the ``treadle`` command: ``treadle config``, each command's
``--help``, and the "did you mean" of another framework's key name (one line, exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.config.test_keys import leaf_keys
from treadle.cli import _parse
from treadle.config import Config

DEFAULT = Path(__file__).resolve().parents[1] / "recipes" / "default.yaml"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def treadle(*args: str) -> subprocess.CompletedProcess:
    """``treadle ARGS`` in a subprocess, its output piped (not a terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "treadle.cli", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_config_lists_every_leaf_key_one_line_each_when_piped():
    r = treadle("config")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines] == leaf_keys(Config)
    lr = next(line for line in lines if line.startswith("trainer.lr "))
    assert lr.split()[1:3] == ["float", "0.0001"] and "learning rate" in lr
    n = next(line for line in lines if line.startswith("rollout.n "))
    assert n.split()[1:3] == ["int", "8"] and "Samples per prompt" in n


def test_config_of_a_section_and_of_a_key():
    r = treadle("config", "algorithm.kl")
    assert [line.split()[0] for line in r.stdout.splitlines()] == [
        "algorithm.kl.coef",
        "algorithm.kl.estimator",
        "algorithm.kl.placement",
    ]
    r = treadle("config", "rollout.dtype")
    assert r.returncode == 0
    assert r.stdout.startswith("rollout.dtype  (auto|float32|bfloat16, default float32)\n")
    assert "fp32 master weights" in r.stdout  # the whole description, not its first sentence


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("config", "rollot"), "config: no section or key rollot; did you mean rollout?"),
        (
            ("train", str(DEFAULT), "trainer.learning_rate=1e-5"),
            "config: unknown key trainer.learning_rate; did you mean trainer.lr? "
            "(learning_rate is TRL's name)",
        ),
        (
            ("train", str(DEFAULT), "actor_rollout_ref.rollout.n=4"),
            "config: unknown key actor_rollout_ref.rollout.n; did you mean rollout.n? "
            "(actor_rollout_ref.rollout.n is verl's name)",
        ),
    ],
)
def test_unknown_names_are_one_line_exit_2(args, says):
    r = treadle(*args)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"treadle: error: {says}"], r.stderr


@pytest.mark.parametrize(
    ("command", "says"),
    [
        ("train", ["Writes RUN_DIR: config.yaml", "treadle train recipes/default.yaml"]),
        ("sft", ["RUN_DIR/sft_model", "treadle sft recipes/default.yaml sft.steps=200"]),
        ("dpo", ["RUN_DIR/dpo_model", "treadle dpo recipes/dpo.yaml"]),
        ("reward-check", ["Writes nothing", "treadle reward-check recipes/default.yaml"]),
        ("serve-reward", ["POST /score", "treadle serve-reward recipes/default.yaml"]),
        ("inspect", ["RUN_DIR/buffer/", "treadle inspect runs/default --step 41 --replay"]),
        ("config", ["one line per key when piped", "treadle config rollout"]),
    ],
)
def test_each_command_help_says_what_it_reads_and_writes_with_an_example(command, says):
    from treadle.cli import _parser

    sub = next(a for a in _parser()._actions if a.dest == "command").choices[command]
    text = sub.format_help()
    assert "Reads " in text and "\nexamples:\n  treadle " in text
    assert all(s in " ".join(text.split()) or s in text for s in says), text


@pytest.mark.parametrize(
    ("argv", "overrides"),
    [
        # argparse gave the overrides list only the words before --output: the rest were
        # "unrecognized arguments" (exit 2), though the README writes options anywhere.
        (["eval", "runs/r", "--output", "o", "eval.k=[1,4]"], ["eval.k=[1,4]"]),
        (["eval", "runs/r", "r.yaml", "a=1", "--overwrite", "b=2"], ["a=1", "b=2"]),
        (["serve-reward", "r.yaml", "--port", "9000", "reward.workers=0"], ["reward.workers=0"]),
    ],
)
def test_overrides_after_an_option_are_overrides(argv, overrides):
    assert _parse(argv).overrides == overrides


@pytest.mark.parametrize(
    "argv",
    [["eval", "runs/r", "--output", "o", "extra"], ["inspect", "runs/r", "--step", "1", "a=1"]],
)
def test_a_word_that_is_no_override_after_an_option_is_still_refused(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        _parse(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: " in err
    assert f"(treadle {argv[0]} --help lists the options)" in err  # the command's own help


def test_a_ctrl_c_while_torch_imports_is_one_line_exit_130(tmp_path):
    # a `torch` that stops importing as a Ctrl-C would: no traceback, nothing written
    (tmp_path / "torch.py").write_text("raise KeyboardInterrupt\n")
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{root}",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    done = subprocess.run([sys.executable, "-m", "treadle.cli", "eval", str(tmp_path / "m")],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 130
    assert done.stderr == "treadle: interrupted while starting; nothing was written\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["torch.py"]


def test_a_ctrl_c_while_the_cli_itself_imports_is_one_line_exit_130(tmp_path):
    # the console script's first import is treadle._entry, which imports nothing; a Ctrl-C
    # while treadle.cli's own modules import (an `argparse` that stops as a Ctrl-C would)
    # is one line and 130, where it was a traceback
    (tmp_path / "argparse.py").write_text("raise KeyboardInterrupt\n")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{root}",
           "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
    script = "import sys; from treadle._entry import main; sys.exit(main())"  # as pip writes it
    done = subprocess.run([sys.executable, "-c", script, "plan", "qwen2.5-7b"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert (done.returncode, done.stderr) == (
        130, "treadle: interrupted while starting; nothing was written\n")  # fmt: skip
    assert done.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == ["argparse.py"]


def test_the_console_script_runs_the_cli():
    import tomllib

    from treadle._entry import main

    root = Path(__file__).resolve().parents[1]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["treadle"] == "treadle._entry:main"
    assert main.__module__ == "treadle._entry"
    done = subprocess.run([sys.executable, "-c", "import sys; from treadle._entry import main; "
                           "sys.exit(main())", "config", "algorithm.kl.coef"],
                          capture_output=True, text=True, timeout=120, cwd=root)  # fmt: skip
    assert done.returncode == 0 and "kl" in done.stdout, done.stderr


def test_every_commands_help_formats():
    # argparse formats a help string with %: a bare "1%" in one option's help made
    # `treadle simulate --help` raise ValueError (2026-12-06)
    from treadle.cli import _parser

    choices = next(a for a in _parser()._actions if a.dest == "command").choices
    for name, sub in choices.items():
        assert sub.format_help().startswith(f"usage: treadle {name}"), name
