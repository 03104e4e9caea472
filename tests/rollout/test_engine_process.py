"""An engine in a process of its own (``rollout.engine_process=own``): the scripted fake engine
(20 ms a step, a completion of 40 tokens less its prompt) served from a child process. The
RequestEngine contract itself runs over the transformers and vLLM engines in their own process
in tests/contracts/test_request_engine.py; here, what only a second process can get wrong:
requests that run while nobody steps, aborts racing completions, weights crossing, a child
that dies, and a parent that dies."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from treadle.core.errors import UserError
from treadle.core.protocols import EngineSpec, Request, SamplingParams
from treadle.core.types import FinishReason
from treadle.rollout.engines import engine_process
from treadle.rollout.engines.engine_process import EngineProcess, _Metrics, _shared_memory_folder

FAKE = "contracts.fakes:SpecScriptedEngine"
PARAMS = SamplingParams(max_tokens=100)


@pytest.fixture(scope="module")
def engine():
    eng = EngineProcess(FAKE, EngineSpec(model_dir="unused"))
    yield eng
    eng.close()


def collect(engine: EngineProcess, timeout_s: float = 10.0) -> dict:
    out: dict = {}
    end = time.monotonic() + timeout_s
    while engine.running():
        assert time.monotonic() < end, "requests still running"
        for f in engine.step():
            assert f.request_id not in out, f"{f.request_id} came back twice"
            out[f.request_id] = f.completion
    return out


def test_requests_run_while_nobody_steps_and_come_back_once(engine):
    # prompts of 30 and 10 tokens: completions of 40 - 30 = 10 and 40 - 10 = 30 tokens, one a
    # step of 20 ms: done in the child after ~0.2 s and ~0.6 s, whether or not we step
    engine.submit(Request("short", (1,) * 30, PARAMS))
    engine.submit(Request("long", (1,) * 10, PARAMS))
    time.sleep(0.8)
    start = time.monotonic()
    out = collect(engine)
    assert time.monotonic() - start < 0.2  # both were already done in the child
    assert {r: len(c.token_ids) for r, c in out.items()} == {"short": 10, "long": 30}
    assert all(c.finish_reason == FinishReason.STOP for c in out.values())
    assert engine.running() == 0 and engine.step() == []


def test_an_abort_returns_the_prefix_or_a_completion_that_beat_it(engine):
    engine.submit(Request("done", (1,) * 35, PARAMS))  # 5 tokens: ~0.1 s
    engine.submit(Request("cut", (1,) * 10, PARAMS))  # 30 tokens: ~0.6 s
    time.sleep(0.3)  # "done" finished in the child, not yet returned here; "cut" is mid-way
    by_id = {f.request_id: f.completion for f in engine.abort(["done", "cut", "unknown"])}
    assert by_id["done"].finish_reason == FinishReason.STOP and len(by_id["done"].token_ids) == 5
    cut = by_id["cut"]
    # 0.3 s at 20 ms a step: about 15 of its 30 tokens (the bounds allow for a loaded machine)
    assert cut.finish_reason == FinishReason.ABORT and 1 <= len(cut.token_ids) < 30
    assert engine.running() == 0 and engine.step() == []  # neither comes back again
    # continued from its tokens, it finishes the 30 (prompt 10 + k tokens wants 30 - k more)
    engine.submit(Request("rest", (1,) * 10 + cut.token_ids, PARAMS))
    rest = collect(engine)["rest"]
    assert len(cut.token_ids) + len(rest.token_ids) == 30


def test_weights_cross_to_the_child_with_their_version(engine):
    embed = torch.arange(6, dtype=torch.float32).reshape(2, 3)  # sum 15
    # a tied output layer is the same tensor under two names (safetensors refuses shared memory)
    weights = [("model.embed_tokens.weight", embed), ("lm_head.weight", embed), ("b", embed[0])]
    engine.update_weights(weights, version=4)
    assert engine.metrics()["fake/weights_sum"] == 15 + 15 + (0 + 1 + 2)
    assert engine.metrics()["mem/engine_process_peak_gib"] > 0
    engine.submit(Request("after", (1,) * 37, PARAMS))
    (c,) = collect(engine).values()
    assert engine.policy_version == 4 and c.policy_version == 4
    engine.policy_version = 6  # as a resumed run sets it
    engine.submit(Request("later", (1,) * 38, PARAMS))
    assert collect(engine)["later"].policy_version == 6
    assert not list(Path("/dev/shm").glob("tmp*.safetensors"))  # the file is removed


def test_generate_runs_a_batch_in_the_child(engine):
    out = engine.generate([(1,) * 36, (1,) * 38], SamplingParams(n=2, max_tokens=3))
    assert [[len(c.token_ids) for c in group] for group in out] == [[3, 3], [2, 2]]


def test_a_child_that_dies_is_reported_not_waited_for():
    engine = EngineProcess(FAKE, EngineSpec(model_dir="unused"))
    engine.submit(Request("r", (1,) * 10, PARAMS))
    os.kill(engine._process.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"engine process exited \(exit code -9"):
        for _ in range(100):
            engine.step()
    engine.close()  # still closes, once


def test_a_refused_spec_is_a_user_error_in_one_line():
    with pytest.raises(
        UserError, match=re.escape("config model.path=refused: this engine refuses it")
    ):
        EngineProcess(FAKE, EngineSpec(model_dir="refused"))


def test_the_child_exits_when_its_parent_is_killed(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path[:0] = {sys.path!r}
        from treadle.core.protocols import EngineSpec, Request, SamplingParams
        from treadle.rollout.engines.engine_process import EngineProcess
        if __name__ == "__main__":
            eng = EngineProcess({FAKE!r}, EngineSpec(model_dir="unused"))
            eng.submit(Request("r", (1,), SamplingParams(max_tokens=100)))  # ~0.8 s of work
            print(eng._process.pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    path = tmp_path / "parent.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    child = int(proc.stdout.split()[0])
    end = time.monotonic() + 20
    while _alive(child):  # it sees its pipe close at its next poll, after at most a step
        assert time.monotonic() < end, f"engine process {child} outlived its parent"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_ctrl_c_at_the_terminal_reaches_the_parent_only(tmp_path):
    # A terminal sends SIGINT to its whole foreground process group: the parent defers it to the
    # end of its step and checkpoints, so its engine must still serve until closed.
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path[:0] = {sys.path!r}
        from treadle.core.protocols import EngineSpec, Request, SamplingParams
        from treadle.rollout.engines.engine_process import EngineProcess
        if __name__ == "__main__":
            signal.signal(signal.SIGINT, lambda *_: print("parent got SIGINT", flush=True))
            eng = EngineProcess({FAKE!r}, EngineSpec(model_dir="unused"))
            eng.submit(Request("r", (1,) * 30, SamplingParams(max_tokens=100)))  # 10 tokens
            os.killpg(0, signal.SIGINT)  # as Ctrl-C: every process of the group
            time.sleep(0.5)
            done = []
            while eng.running():
                done += eng.step()
            print("tokens", len(done[0].completion.token_ids), flush=True)
            eng.close()
    """)
    path = tmp_path / "parent.py"
    path.write_text(script)
    proc = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=120,
        start_new_session=True,  # its own group, so the SIGINT reaches nothing else
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["parent got SIGINT", "tokens 10"]


def test_neither_side_blocks_when_both_send_into_a_full_pipe(engine):
    # 3,000 requests of 39-token prompts want one token each: the child's messages of finished
    # requests (~100 bytes each, ~300 KB) outgrow the pipe's buffer (~200 KB) while this side,
    # not reading, sends 3,000 more requests (~200 bytes each). The child must keep reading
    # commands while its messages wait, else both block for ever.
    one = SamplingParams(max_tokens=1)
    sent = threading.Event()

    def submit_all():
        for i in range(3000):
            engine.submit(Request(f"a{i}", (1,) * 39, one))
        time.sleep(1.0)  # the child steps them: its messages fill the pipe
        for i in range(3000):
            engine.submit(Request(f"b{i}", (1000,) * 39, one))
        sent.set()

    thread = threading.Thread(target=submit_all, daemon=True)
    thread.start()
    thread.join(60)
    if not sent.is_set():
        os.kill(engine._process.pid, signal.SIGKILL)  # frees this side for the report
        pytest.fail("submitting blocked: both processes were sending into a full pipe")
    out = collect(engine, timeout_s=60)
    assert len(out) == 6000 and {len(c.token_ids) for c in out.values()} == {1}


def test_a_reply_left_by_a_call_cut_short_is_not_taken_for_the_next(engine):
    engine.update_weights([("w", torch.ones(3))], version=engine.policy_version)  # sum 3
    # metrics() interrupted after its send (a second Ctrl-C): its reply is still on its way
    engine._send(_Metrics())
    engine._owed += 1
    out = engine.generate([(1,) * 38], SamplingParams(n=1, max_tokens=5))
    assert [[len(c.token_ids) for c in group] for group in out] == [[2]]  # 40 - 38
    assert engine.metrics()["fake/weights_sum"] == 3  # the next call gets its own reply


def test_a_hung_engine_process_is_killed_at_close(monkeypatch):
    monkeypatch.setattr(engine_process, "_CLOSE_S", 1.0)
    eng = EngineProcess(FAKE, EngineSpec(model_dir="unused"))
    os.kill(eng._process.pid, signal.SIGSTOP)  # hung: it answers nothing
    start = time.monotonic()
    eng.close()
    assert time.monotonic() - start < 10 and not eng._process.is_alive()


def test_it_says_whether_the_engine_takes_single_requests(engine):
    assert engine.serves_requests
    batch_only = EngineProcess("contracts.fakes:SpecBatchOnlyEngine", EngineSpec("unused"))
    try:
        assert not batch_only.serves_requests
        assert batch_only.generate([(1, 2)], SamplingParams(n=2))[0][0].token_ids == (7,)
    finally:
        batch_only.close()


def test_weights_go_to_shared_memory_only_where_they_fit():
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm here: weights always go to the temporary folder")
    assert _shared_memory_folder(1) == Path("/dev/shm")
    assert _shared_memory_folder(2**60) is None  # an exabyte: the temporary folder
