"""Bad input through the real ``treadle`` command: one line on stderr, exit code 2, no traceback,
and nothing left behind (no run directory).

Each case runs ``python -m treadle.cli`` in its own empty folder. The processes are started
together (they spend most of their time importing torch) so the whole file takes about as long
as one of them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from treadle.config import load_config
from treadle.core.errors import UserError

DEFAULT = Path(__file__).resolve().parents[1] / "recipes" / "default.yaml"
# File data needs no worked steps and a reward that can score it.
FILE_DATA = ["data.source=jsonl", "data.reasoning=none", "reward.functions=[{name: math_verify}]"]
# Small reasoning-gym data so the cases that load it before failing stay fast.
SMALL = ["rollout.engine=hf", "data.size=50", "data.eval_size=10"]


@dataclass
class Case:
    args: list[str]
    files: dict[str, str]
    """Input files written into the case's folder before the run (name -> content)."""
    expected: list[str]
    """Strings the single stderr line must contain ({dir} is the case's folder)."""


CASES = {
    "missing-model-folder": Case(
        ["train", str(DEFAULT), *SMALL, "model.path=/nonexistent"],
        {},
        ["model.path /nonexistent", "config.json"],
    ),
    "malformed-jsonl-line": Case(
        [
            "train",
            str(DEFAULT),
            *SMALL,
            *FILE_DATA,
            "data.path={dir}/d.jsonl",
        ],
        {"d.jsonl": '{"question": "1 + 1", "answer": "2"}\n{"question": "2 + 2", answer}\n'},
        ["{dir}/d.jsonl:2:", "malformed JSON"],
    ),
    "unknown-config-key": Case(
        ["train", str(DEFAULT), *SMALL, "trainer.lrr=1e-5"],
        {},
        ["trainer.lrr", "did you mean trainer.lr?"],
    ),
    "gpu-bundles-without-a-gpu": Case(
        ["train", str(DEFAULT), *SMALL, "placement.mode=disaggregated", "placement.trainer_gpus=1"],
        {},
        ["placement:", "no GPU is visible"],
    ),
    "model-folder-without-weights": Case(
        ["train", str(DEFAULT), *SMALL, "model.path={dir}/m"],
        {"m/config.json": '{"model_type": "qwen2"}'},
        ["model.path {dir}/m", "config.json but no weights"],
    ),
    "prompts-longer-than-the-context": Case(
        # The tiny model is built in the run directory before this is known: the failed start
        # removes what it made.
        ["train", str(DEFAULT), *SMALL, "sft.steps=0", "rollout.max_tokens=510"],
        {},
        ["exceed the model's context of 512 tokens"],
    ),
    # What a training backend would refuse only once built, refused from the model's config
    # before the run directory (or the SFT warm-up) exists: the built tiny model's 2 KV heads
    # over tensor parallel 3, a LoRA target it has no linear of, megatron's bf16 on a CPU.
    "megatron-tensor-parallel-that-does-not-divide-the-heads": Case(
        [
            "train",
            str(DEFAULT),
            *SMALL,
            "trainer.backend=megatron",
            "trainer.megatron.tensor_parallel=3",
            "placement.mode=disaggregated",
            "placement.trainers=3",
        ],
        {},
        ["trainer.megatron.tensor_parallel=3", "does not divide the model's KV heads (2)"],
    ),
    "lora-target-that-is-not-a-linear": Case(
        ["train", str(DEFAULT), *SMALL, "model.lora.r=8", "model.lora.target_modules=[nope]"],
        {},
        ["model.lora.target_modules: ['nope'] are not linear modules", "q_proj"],
    ),
    "megatron-bf16-on-a-cpu": Case(
        ["train", str(DEFAULT), *SMALL, "trainer.backend=megatron", "trainer.bf16_autocast=true"],
        {},
        ["trainer.bf16_autocast=true with trainer.backend=megatron", "autocast for CUDA only"],
    ),
    "empty-dataset": Case(
        [
            "train",
            str(DEFAULT),
            *SMALL,
            *FILE_DATA,
            "data.path={dir}/empty.jsonl",
        ],
        {"empty.jsonl": ""},
        ["data.path {dir}/empty.jsonl", "0 usable rows"],
    ),
}


@dataclass
class Result:
    folder: Path
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Result]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    running = {}
    for name, case in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        for file, content in case.files.items():
            (folder / file).parent.mkdir(parents=True, exist_ok=True)
            (folder / file).write_text(content)
        args = [a.replace("{dir}", str(folder)) for a in case.args]
        running[name] = (
            folder,
            subprocess.Popen(
                [sys.executable, "-m", "treadle.cli", *args],
                cwd=folder,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
    out = {}
    for name, (folder, proc) in running.items():
        try:
            stdout, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        out[name] = Result(folder, proc.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(results, name):
    case, r = CASES[name], results[name]
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("treadle: error: ")
    for text in case.expected:
        assert text.replace("{dir}", str(r.folder)) in lines[0]
    # Failing before any work: no run directory (runs/default/config.yaml), no built model,
    # nothing at all besides the input files.
    assert not (r.folder / "runs").exists()
    assert sorted(p.name for p in r.folder.iterdir()) == sorted(
        {f.split("/")[0] for f in case.files}
    )


# The same guarantees for the library entry points, in this process (no torch import per case).


def test_sft_only_with_a_missing_model_folder_leaves_no_run_dir(tmp_path, monkeypatch):
    from treadle.jobs.sft import sft_only

    monkeypatch.chdir(tmp_path)
    cfg = load_config(DEFAULT, [*SMALL, "model.path=/nonexistent"])
    with pytest.raises(UserError, match=re.escape("model.path /nonexistent")):
        sft_only(cfg)
    assert list(tmp_path.iterdir()) == []


def test_template_typo_fails_before_the_run_dir_exists(tmp_path, monkeypatch):
    from treadle.jobs.train import train

    monkeypatch.chdir(tmp_path)
    # The typo is caught while loading the config, before train() could create anything.
    with pytest.raises(UserError, match=re.escape("data.answer_template")):
        train(load_config(DEFAULT, [*SMALL, "data.answer_template=<answer>{ans}</answer>"]))
    assert list(tmp_path.iterdir()) == []


def test_prompts_too_long_for_the_context_fail_before_sft(tmp_path, monkeypatch):
    import time

    from treadle.jobs.train import train

    monkeypatch.chdir(tmp_path)
    # 500 completion tokens + any prompt exceed the 512-token context: refused before the
    # 800-step SFT warm-up of the default recipe starts (no sft/ metrics are written).
    cfg = load_config(DEFAULT, [*SMALL, "rollout.max_tokens=500", "rollout.engine=hf"])
    started = time.perf_counter()
    with pytest.raises(UserError, match="exceed the model's context of 512 tokens"):
        train(cfg)
    assert time.perf_counter() - started < 60
    assert not (tmp_path / "runs" / cfg.run.name / "sft").exists()


@pytest.mark.parametrize(
    ("given", "expected"),
    [({}, "16"), ({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}, "1024"),
     ({"DNNL_PRIMITIVE_CACHE_CAPACITY": "1024"}, None)],  # oneDNN's older name, also the user's
)  # fmt: skip
def test_the_command_caps_onednn_primitive_cache_unless_the_user_set_it(given, expected):
    # oneDNN reads the variable once, at its first primitive: the command must set it before
    # anything runs (16 primitives instead of 1,024; see BENCHMARKS.md, "Memory per phase").
    names = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")
    env = {k: v for k, v in os.environ.items() if k not in names} | given
    code = "import os, treadle.cli; print(os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(expected)


def test_a_tokenizer_without_a_chat_template_fails_before_the_run_dir_exists(tmp_path, monkeypatch):
    from treadle.config import TinyModelConfig
    from treadle.jobs.train import train
    from treadle.store.models import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer(["one plus two is three"], 280)
    model = build_tiny_model(TinyModelConfig(hidden_size=16, intermediate_size=32), tokenizer, 0)
    tokenizer.chat_template = None  # a base model's tokenizer: no template to render prompts
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        UserError, match=re.escape(f"{tmp_path / 'base'}: the tokenizer has no chat")
    ):
        train(load_config(DEFAULT, [*SMALL, f"model.path={tmp_path / 'base'}"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


def test_truncated_weights_in_model_path_fail_before_the_run_dir_exists(tmp_path, monkeypatch):
    from treadle.config import TinyModelConfig
    from treadle.jobs.train import train
    from treadle.store.models import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer(["one plus two is three"], 280)
    model = build_tiny_model(TinyModelConfig(hidden_size=16, intermediate_size=32), tokenizer, 0)
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    weights = tmp_path / "base" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])  # a copy cut short
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=re.escape(f"{weights} cannot be read")):
        train(load_config(DEFAULT, [*SMALL, f"model.path={tmp_path / 'base'}"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only tmpfs needs root")
def test_a_read_only_run_directory_is_one_line_before_any_work(tmp_path):
    import subprocess

    from treadle.store.manifest import require_writable

    folder = tmp_path / "ro"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], check=True)
    try:
        with pytest.raises(UserError, match=r"cannot write in .*ro \(Read-only file system\)"):
            require_writable(folder)
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
    require_writable(tmp_path)  # a writable one passes and keeps nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"]


def test_a_signal_before_the_run_began_says_to_run_again(tmp_path):
    import argparse
    import signal

    from treadle.cli import _stopped
    from treadle.jobs.stopping import Stopped

    args = argparse.Namespace(command="train", resume=None)
    line = _stopped(Stopped(signal.SIGTERM), args)
    assert line == "stopped by SIGTERM at once, before the run began; run the command again"
    (tmp_path / "config.yaml").write_text("{}")
    stop = Stopped(signal.SIGINT, 3, tmp_path / "checkpoints" / "step_000003")
    stop.run_dir = tmp_path
    assert _stopped(stop, args).startswith(
        f"stopped by SIGINT after step 3, checkpoint step_000003 saved; continue with: "
        f"treadle train --resume {tmp_path} "
    )


def test_a_full_disk_in_a_background_writer_prints_no_traceback():
    import errno
    import threading

    from treadle.cli import _quiet_disk_full

    seen = []
    hook = _quiet_disk_full(seen.append)
    full = OSError(errno.ENOSPC, "No space left on device")
    hook(threading.ExceptHookArgs((OSError, full, None, None)))
    assert seen == []  # the main thread reports it, once
    other = threading.ExceptHookArgs((ValueError, ValueError("bug"), None, None))
    hook(other)
    assert seen == [other]  # everything else keeps its traceback


def _to_a_gone_reader(argv: list[str], stderr_too: bool = False,
                      stdout=None) -> subprocess.CompletedProcess:  # fmt: skip
    """Run ``argv`` with stdout (and stderr, with ``stderr_too``) a pipe whose read end is
    closed before the process starts, so every write fails (EPIPE): no race; ``stdout``, a
    file, in place of the pipe for stdout. Python's stdout block-buffered, as in a shell
    (PYTHONUNBUFFERED unset)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(argv, stdout=write if stdout is None else stdout,
                              stderr=write if stderr_too else subprocess.PIPE, text=True,
                              timeout=300, env=env)  # fmt: skip
    finally:
        os.close(write)


@pytest.mark.parametrize(
    "command",
    [
        ["config"],  # rich's table
        ["config", "model"],  # plain lines, print()'s buffer flushed at the end
        ["plan", "qwen2.5-0.5b", "--gpus", "2", "--steps", "2"],
        ["simulate", "qwen2.5-0.5b", "--gpus", "2", "--steps", "2", "--json"],
        ["simulate", "--help"],  # argparse prints, then raises SystemExit(0)
    ],
)
def test_a_reader_that_goes_away_ends_the_command_quietly(command):
    # `treadle config | head -1`: exit 0 with nothing on stderr, not a traceback, Python's
    # "Exception ignored ... BrokenPipeError" at exit (status 120) or rich's status 1
    done = _to_a_gone_reader([sys.executable, "-m", "treadle.cli", *command])
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize(
    "bad",
    [["--sync-seconds", "0"], ["--bogus"]],  # treadle's refusal, argparse's
)
def test_an_error_keeps_its_status_when_stderr_has_no_reader_either(bad):
    # `treadle simulate ... 2>&1 | true`: the message is lost, the status 2 is not (argparse's
    # usage text left in stderr's buffer made Python's flush at exit fail: status 120)
    argv = [sys.executable, "-m", "treadle.cli", "simulate", "qwen2.5-0.5b", *bad]
    assert _to_a_gone_reader(argv, stderr_too=True).returncode == 2


def test_a_stderr_without_a_reader_leaves_stdout_whole(tmp_path):
    # `treadle simulate ... --plot P > out 2>&1-to-a-closed-pipe`: the "plot: P" line is lost;
    # rich's own console pointed stdout at /dev/null and exited 1 there (then 120)
    png, out = tmp_path / "t.png", tmp_path / "out.txt"
    argv = [sys.executable, "-m", "treadle.cli", "simulate", "qwen2.5-0.5b", "--gpus", "2",
            "--steps", "2", "--json", "--plot", str(png)]  # fmt: skip
    with out.open("w") as f:
        assert _to_a_gone_reader(argv, stderr_too=True, stdout=f).returncode == 0
    (row,) = json.loads(out.read_text())
    assert row["steps"] == 2 and png.stat().st_size > 10_000


SIMULATE_JSON = [sys.executable, "-m", "treadle.cli", "simulate", "qwen2.5-0.5b", "--gpus", "2",
                 "--steps", "2", "--json"]  # fmt: skip


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_stderr_on_a_full_disk_loses_the_messages_not_the_result():
    # `treadle simulate ... --json 2>/dev/full`: rich's progress display fails with ENOSPC
    # (unbuffered, each write at once); the JSON still reaches stdout and the status is 0 (it
    # was 2, blamed on stdout, and no JSON)
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    with open("/dev/full", "w") as full:
        done = subprocess.run(SIMULATE_JSON, stdout=subprocess.PIPE, stderr=full, text=True,
                              timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0
    assert json.loads(done.stdout)[0]["steps"] == 2


def test_on_a_terminal_the_status_line_shows_and_the_run_ends():
    # on a pty rich's status line puts a proxy in sys.stderr that prints through the console;
    # the console writing into it looped for good (any run past the first refresh, ~80 ms:
    # this one takes ~0.4 s), deaf to Ctrl-C, until 2026-12-07
    import threading

    master, slave = os.openpty()
    env = os.environ | {"TERM": "xterm", "COLUMNS": "100"}
    proc = subprocess.Popen([sys.executable, "-m", "treadle.cli", "simulate", "qwen2.5-0.5b"],
                            stdin=slave, stdout=slave, stderr=slave, env=env)  # fmt: skip
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:  # the pty's buffer is small: read it while the command writes
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the command is gone
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
        reader.join(10)
        os.close(master)
    out = b"".join(chunks).decode(errors="replace")
    assert "simulating step" in out and "steps simulated" in out


@pytest.mark.parametrize("fd", [1, 2])
def test_a_descriptor_closed_before_the_start_is_nothing_to_write(fd):
    # `treadle simulate ... >&-` or `2>&-`: Python's sys.stdout or sys.stderr is None (it
    # raised AttributeError at the end). Without stdout the answer has nowhere to go: one line,
    # status 2, as ls and echo refuse a closed stdout; without stderr the messages are lost and
    # the command runs to its status 0
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run(SIMULATE_JSON, preexec_fn=lambda: os.close(fd), env=env,
                          stdout=subprocess.DEVNULL if fd == 2 else None,
                          stderr=subprocess.PIPE if fd == 1 else None, timeout=300)  # fmt: skip
    assert done.returncode == (2 if fd == 1 else 0)
    if fd == 1:
        assert done.stderr.decode().startswith("treadle: error: stdout is closed;")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
@pytest.mark.parametrize("command", [["config"], ["config", "model"], ["--help"]])
def test_stdout_on_a_full_disk_is_one_line_and_exit_2(command):
    # /dev/full fails every write with ENOSPC: one line, no traceback, status 2
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "treadle.cli", *command], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == "treadle: error: cannot write stdout (No space left on device)\n"


def test_a_rich_console_whose_reader_goes_away_lets_the_command_carry_on():
    # a training run printing its steps through rich is not cut short by a closed pager: the
    # console drops its output and the code after the failed write runs
    code = (
        "import sys; from treadle.cli import _console; c = _console(); c.print('x' * 70000); "
        "c.print('more'); print('carried on', file=sys.stderr); sys.exit(3)"
    )
    done = _to_a_gone_reader([sys.executable, "-c", code])
    assert (done.returncode, done.stderr) == (3, "carried on\n")


def test_a_broken_pipe_that_is_not_stdouts_is_not_swallowed(monkeypatch):
    # a reward server's socket or a subprocess's pipe failing is an error of the command,
    # not a reader going away: it propagates (here stdout is pytest's capture, no pipe)
    import treadle.cli as cli

    def broken(name):
        raise BrokenPipeError(32, "reward server socket")

    monkeypatch.setattr(cli, "_config", broken)
    with pytest.raises(BrokenPipeError, match="reward server socket"):
        cli.main(["config"])
