"""rollout.engine/dtype=auto and the engine process's preloaded libraries, resolved per machine
and model size (treadle/rollout/engines/choice.py's rules)."""

from pathlib import Path

import pytest

from treadle.config import load_config
from treadle.core.cpu import CpuFeatures
from treadle.rollout.engines.choice import (
    BF16_FROM_PARAMS,
    HF_BELOW_PARAMS,
    choose,
    resolved,
    with_preload,
)

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "default.yaml"
AMX = CpuFeatures("Xeon", 2, avx2=True, avx512=True, avx512_bf16=True, amx_bf16=True)
AVX2 = CpuFeatures("EPYC", 2, avx2=True, avx512=False, avx512_bf16=False, amx_bf16=False)
# Inputs, not results: model sizes as parameter_count reads them from the safetensors headers.
DEFAULT_MODEL = 434_304  # the default recipe's built model (a run's summary.json machine)
QWEN_05B = 493_793_536  # the Qwen2.5-0.5B shape with the Qwen3 tokenizer (bench/shapes.py)


def cfg(*overrides):
    return load_config(RECIPE, ["rollout.engine=auto", "rollout.dtype=auto", *overrides])


def test_default_model_gets_hf_in_fp32_except_on_amx():
    c = choose(cfg(), DEFAULT_MODEL, AVX2, cuda=False, vllm_installed=True)
    assert (c.engine, c.dtype) == ("hf", "float32")
    assert "0.43M parameters < 1M" in c.describe()
    # on the AMX Xeon vLLM measured 1.62x generate at 0.4M parameters (BENCHMARKS.md)
    amx = choose(cfg(), DEFAULT_MODEL, AMX, cuda=False, vllm_installed=True)
    assert (amx.engine, amx.dtype) == ("vllm", "float32")


def test_large_model_bf16_only_where_native():
    amx = choose(cfg(), QWEN_05B, AMX, cuda=False, vllm_installed=True)
    avx2 = choose(cfg(), QWEN_05B, AVX2, cuda=False, vllm_installed=True)
    assert (amx.engine, amx.dtype) == ("vllm", "bfloat16")
    assert (avx2.engine, avx2.dtype) == ("vllm", "float32")
    assert "bf16 emulated on this CPU" in avx2.describe()
    # the thresholds are where the rules say: one parameter either side
    assert choose(cfg(), HF_BELOW_PARAMS, AVX2, False, True).engine == "vllm"
    assert choose(cfg(), HF_BELOW_PARAMS - 1, AVX2, False, True).engine == "hf"
    assert choose(cfg(), BF16_FROM_PARAMS - 1, AMX, False, True).dtype == "float32"
    assert choose(cfg(), BF16_FROM_PARAMS, AMX, False, True).dtype == "bfloat16"


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("rollout.mode=async", "rollout.mode=async"),
        ("rollout.tensor_parallel=2", "tensor parallel"),
    ],
)
def test_vllm_where_only_it_serves_the_run(override, why):
    c = choose(cfg(override), DEFAULT_MODEL, AVX2, cuda=False, vllm_installed=True)
    assert c.engine == "vllm" and why in c.describe()


def test_gpu_and_missing_vllm():
    gpu = choose(cfg(), DEFAULT_MODEL, AVX2, cuda=True, vllm_installed=True)
    assert (gpu.engine, gpu.dtype) == ("vllm", "float32")  # small: fp32 even on a GPU
    assert choose(cfg(), QWEN_05B, AVX2, cuda=True, vllm_installed=True).dtype == "bfloat16"
    assert choose(cfg(), QWEN_05B, AMX, cuda=False, vllm_installed=False).engine == "hf"
    # a run that needs vllm keeps it, so the start-up check names the missing package
    assert choose(cfg("rollout.mode=async"), QWEN_05B, AMX, False, False).engine == "vllm"
    unknown = choose(cfg(), 0, AVX2, cuda=False, vllm_installed=True)  # *.bin weights only
    assert (unknown.engine, unknown.dtype) == ("vllm", "float32")


def test_explicit_values_are_kept():
    c = choose(
        cfg("rollout.engine=vllm", "rollout.dtype=bfloat16"), DEFAULT_MODEL, AVX2, False, True
    )
    assert (c.engine, c.dtype, c.reasons) == ("vllm", "bfloat16", ())
    assert c.describe() == "machine: EPYC, 2 cores, avx2 (bf16 emulated); engine vllm, bfloat16"
    r = resolved(cfg(), choose(cfg(), QWEN_05B, AMX, False, True)).rollout
    assert (r.engine, r.dtype) == ("vllm", "bfloat16")


def test_preload_only_for_vllm_in_its_own_process(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    vllm = choose(cfg("rollout.mode=async"), QWEN_05B, AVX2, False, True)
    c = with_preload(vllm, own_process=True, enabled=True, prefix=str(tmp_path))
    assert c.preload == (str(tmp_path / "lib" / "libiomp5.so"),)
    assert "not found to preload: libtcmalloc_minimal.so.4" in c.describe()
    assert c.as_dict()["preload"] == ["libiomp5.so"]
    assert with_preload(vllm, False, True, str(tmp_path)).preload == ()  # in this process
    assert with_preload(vllm, True, False, str(tmp_path)).preload == ()  # rollout.preload off
    hf = choose(cfg(), DEFAULT_MODEL, AVX2, False, True)
    assert with_preload(hf, True, True, str(tmp_path)).preload == ()


def test_preloaded_env_is_set_for_the_spawn_and_restored(monkeypatch):
    from treadle.rollout.engines.engine_process import _preloaded

    monkeypatch.setenv("LD_PRELOAD", "/inherited.so")
    with _preloaded(["/a/libtcmalloc_minimal.so.4", "/a/libiomp5.so"]):
        import os

        assert os.environ["LD_PRELOAD"] == (
            "/a/libtcmalloc_minimal.so.4:/a/libiomp5.so:/inherited.so"
        )
    assert os.environ["LD_PRELOAD"] == "/inherited.so"
    monkeypatch.delenv("LD_PRELOAD")
    with _preloaded(["/a/libiomp5.so"]):
        assert os.environ["LD_PRELOAD"] == "/a/libiomp5.so"
    assert "LD_PRELOAD" not in os.environ
    with _preloaded([]):  # nothing to preload: nothing set
        assert "LD_PRELOAD" not in os.environ
