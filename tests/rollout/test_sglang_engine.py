"""treadle's SGLang adapter against SGLang's documented offline API, through a fake ``sglang``.

SGLang does not run on this CPU, so these tests check the adapter, not SGLang: what
:class:`SGLangEngine` sends to ``sglang.Engine`` (constructor arguments, ``generate``'s
``input_ids``/``sampling_params``/``return_logprob``, ``update_weights_from_tensor``'s tensors)
and how it maps outputs in SGLang's documented format (``output_ids``, ``meta_info`` with
``output_token_logprobs``/``input_token_logprobs`` triples and ``finish_reason.type``) back to
token ids, logprobs and finish reasons. The fake is injected in ``sys.modules``; the refusal
tests run without it, as a user on this machine would.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from treadle.config import load_config
from treadle.core.errors import UserError
from treadle.core.protocols import EngineSpec, SamplingParams
from treadle.core.types import FinishReason
from treadle.rollout.engines import build_engine
from treadle.rollout.engines.sglang_engine import SGLangEngine, load_sglang
from treadle.store.models import build_tokenizer

EOS = 7


class FakeSGLangEngine:
    """Records every call; answers in SGLang's documented output format. Request ``i`` of a
    ``generate`` samples ``last + 1, last + 2, ...`` (``last``: its prompt's last token) with
    logprob ``-0.1 * (i + 1) * (k + 1)`` at step ``k``; it ends with EOS (``stop``) when
    ``max_new_tokens`` is at least 3, else runs out (``length``); a prompt starting with 99 is
    aborted with no finish reason object (``None``)."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.update_result = kwargs, [], (True, "Succeeded")

    def generate(self, input_ids, sampling_params, return_logprob, logprob_start_len=None):
        self.calls.append(
            ("generate", input_ids, sampling_params, return_logprob, logprob_start_len)
        )
        outs = []
        for i, (ids, sp) in enumerate(zip(input_ids, sampling_params, strict=True)):
            n = sp["max_new_tokens"]
            new = [ids[-1] + 1 + k for k in range(min(n, 2))] + ([EOS] if n >= 3 else [])
            lps = [(-0.1 * (i + 1) * (k + 1), t, None) for k, t in enumerate(new)]
            reason = {"type": "stop", "matched": EOS} if n >= 3 else {"type": "length", "length": n}
            meta = {"output_token_logprobs": lps, "finish_reason": reason}
            if ids[0] == 99:
                meta["finish_reason"] = None
            if logprob_start_len == 0:  # one triple per input token, the first without logprob
                meta["input_token_logprobs"] = [(None, ids[0], None)] + [
                    (-0.01 * (p + 1), t, None) for p, t in enumerate(ids[1:])
                ]
            outs.append({"text": "", "output_ids": new, "meta_info": meta})
        return outs

    def update_weights_from_tensor(self, named_tensors, flush_cache=True):
        self.calls.append(("update", named_tensors, flush_cache))
        return self.update_result

    def shutdown(self):
        self.calls.append(("shutdown",))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sglang") / "model"
    build_tokenizer([f"w{i} {i}" for i in range(40)], 300).save_pretrained(folder)
    return folder


@pytest.fixture
def engine(model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FakeSGLangEngine))
    spec = EngineSpec(
        str(model_dir), dtype="bfloat16", seed=3, max_model_len=640, tensor_parallel=2
    )
    eng = build_engine("sglang", spec)
    assert isinstance(eng, SGLangEngine)
    yield eng, eng._engine
    eng.close()


def test_the_engine_is_started_with_the_spec(engine, model_dir):
    _, fake = engine
    assert fake.kwargs["model_path"] == str(model_dir)
    assert (fake.kwargs["tp_size"], fake.kwargs["dtype"]) == (2, "bfloat16")
    assert (fake.kwargs["random_seed"], fake.kwargs["context_length"]) == (3, 640)
    assert fake.kwargs["sampling_backend"] == "pytorch"  # flashinfer refuses per-request seeds


def test_generate_sends_token_ids_and_maps_ids_logprobs_and_finish_reasons_back(engine):
    eng, fake = engine
    params = SamplingParams(n=2, temperature=0.7, max_tokens=5, stop=("</a>",), seed=10)
    out = eng.generate([[1, 2], [3, 4, 5]], params)
    _, sent, sampling, want_logprobs, _ = fake.calls[-1]
    assert sent == [[1, 2], [1, 2], [3, 4, 5], [3, 4, 5]]  # n samples as n requests, in order
    assert want_logprobs is True
    assert [s["sampling_seed"] for s in sampling] == [10, 11, 12, 13]  # seed + request index
    assert sampling[0] == {
        "temperature": 0.7, "top_p": 1.0, "max_new_tokens": 5, "stop": ["</a>"],
        "no_stop_trim": True, "skip_special_tokens": True, "sampling_seed": 10,
    }  # fmt: skip
    assert [len(g) for g in out] == [2, 2]
    # Request 2 (the first sample of prompt [3, 4, 5]): tokens 6, 7 (= 5 + 1, 5 + 2) and EOS 7;
    # logprobs -0.1 * 3 * (1, 2, 3) = -0.3, -0.6, -0.9.
    c = out[1][0]
    assert c.token_ids == (6, 7, EOS)
    assert c.logprobs == pytest.approx((-0.3, -0.6, -0.9))
    assert c.finish_reason is FinishReason.STOP and c.policy_version == 0
    assert c.text == eng._tokenizer.decode([6, 7, EOS], skip_special_tokens=True)


def test_length_and_abort_finish_reasons_and_no_seed(engine):
    eng, fake = engine
    out = eng.generate([[1, 2], [99, 4]], SamplingParams(n=1, temperature=0.0, max_tokens=2))
    assert all("sampling_seed" not in s for s in fake.calls[-1][2])
    assert fake.calls[-1][2][0]["temperature"] == 0.0  # SGLang's greedy
    assert out[0][0].finish_reason is FinishReason.LENGTH and out[0][0].token_ids == (3, 4)
    assert out[1][0].finish_reason is FinishReason.ABORT  # finish_reason None: aborted


def test_logprobs_of_other_tokens_are_refused(engine, monkeypatch):
    eng, fake = engine
    real = fake.generate

    def shifted(*args, **kwargs):
        outs = real(*args, **kwargs)
        outs[0]["meta_info"]["output_token_logprobs"].pop()  # one logprob short
        return outs

    monkeypatch.setattr(fake, "generate", shifted)
    with pytest.raises(RuntimeError, match="2 output_token_logprobs for 3 output_ids"):
        eng.generate([[1, 2]], SamplingParams(max_tokens=4))


def test_update_weights_hands_the_trainers_tensors_over_and_flushes_the_cache(engine):
    eng, fake = engine
    w = torch.ones(2, 3)
    eng.update_weights(iter([("model.embed_tokens.weight", w)]), version=4)
    _, named, flush = fake.calls[-1]
    assert flush is True and named[0][0] == "model.embed_tokens.weight" and named[0][1] is w
    assert eng.policy_version == 4
    assert eng.generate([[1, 2]], SamplingParams(max_tokens=3))[0][0].policy_version == 4
    fake.update_result = (False, "shape mismatch for lm_head.weight")
    with pytest.raises(RuntimeError, match=r"shape mismatch for lm_head\.weight"):
        eng.update_weights([("lm_head.weight", w)], version=5)
    assert eng.policy_version == 4  # not served as version 5


def test_prompt_logprobs_from_input_token_logprobs(engine):
    eng, fake = engine
    got = eng.prompt_logprobs([[5, 6, 7], [8, 9]])
    assert fake.calls[-1][4] == 0  # logprob_start_len=0: from the first token
    assert fake.calls[-1][2][0] == {"temperature": 1.0, "max_new_tokens": 1}
    # index 0 is 0.0; position p >= 1 has -0.01 * p in the fake
    assert got == [[0.0, pytest.approx(-0.01), pytest.approx(-0.02)], [0.0, pytest.approx(-0.01)]]


def test_close_shuts_sglang_down_once(engine):
    eng, fake = engine
    eng.close()
    eng.close()
    assert [c for c in fake.calls if c[0] == "shutdown"] == [("shutdown",)]


def test_without_sglang_the_engine_is_refused_in_one_line(monkeypatch, model_dir):
    monkeypatch.setitem(sys.modules, "sglang", None)  # as where it is not installed
    with pytest.raises(UserError) as e:
        build_engine("sglang", EngineSpec(str(model_dir)))
    msg = str(e.value)
    assert msg.startswith("config rollout.engine=sglang: SGLang does not load (ModuleNotFound")
    assert "pip install sglang on a GPU machine" in msg and "\n" not in msg


def test_an_sglang_whose_kernels_do_not_load_is_refused_in_one_line(monkeypatch):
    """As on a CPU machine where sglang installs: its lazy ``Engine`` import loads CUDA
    kernels."""
    broken = types.ModuleType("sglang")

    def no_driver(name):
        raise OSError("libcuda.so.1: cannot open shared object file\nmore detail")

    broken.__getattr__ = no_driver
    monkeypatch.setitem(sys.modules, "sglang", broken)
    with pytest.raises(UserError) as e:
        load_sglang()
    assert str(e.value) == (
        "config rollout.engine=sglang: SGLang does not load (OSError: libcuda.so.1: cannot open "
        "shared object file); pip install sglang on a GPU machine (it does not run on CPU), or "
        "set rollout.engine=vllm"
    )


@pytest.mark.slow  # one treadle process: ~10-30 s of imports
@pytest.mark.skipif(
    importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here"
)
def test_treadle_train_refuses_sglang_before_the_run_directory(tmp_path):
    with pytest.raises(UserError, match="pip install sglang on a GPU machine"):
        load_sglang()  # the real import, no fake
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "default.yaml"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    args = ["train", str(recipe), "rollout.engine=sglang", "data.size=50", "data.eval_size=10"]
    r = subprocess.run(
        [sys.executable, "-m", "treadle.cli", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("treadle: error: config rollout.engine=sglang")
    assert "pip install sglang on a GPU machine" in lines[0]
    assert list(tmp_path.iterdir()) == []  # no run directory


def test_sglang_serves_batches_only():
    with pytest.raises(UserError, match=r"rollout\.engine=sglang: serves whole batches only"):
        load_config(None, ["rollout.engine=sglang", "rollout.mode=async"])
    assert load_config(None, ["rollout.engine=sglang"]).rollout.engine == "sglang"
