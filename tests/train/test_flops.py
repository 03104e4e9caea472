"""Model FLOPs utilisation (treadle.train.flops) with golden values, and the backend's perf/mfu."""

from __future__ import annotations

import pytest
import torch

from treadle.config import TrainerConfig
from treadle.core.types import TrainSample
from treadle.train.flops import measured_peak_flops, model_flops_utilisation, peak_flops
from treadle.train.objectives import SFTObjective
from treadle.train.torch_backend import TorchBackend


def test_mfu_is_six_n_t_over_seconds_times_peak():
    # 6 * 1e6 params * 2048 tokens = 1.2288e10 FLOPs in 0.5 s = 2.4576e10 FLOP/s of a 1e12
    # FLOP/s device: 0.024576
    assert model_flops_utilisation(1_000_000, 2048, 0.5, 1e12) == pytest.approx(0.024576)
    # a 0.5B model at 4,000 tokens/s on an H100's bf16 peak: 1.2e13 / 989e12 = 0.01213347
    assert model_flops_utilisation(500_000_000, 4000, 1.0, 989e12) == pytest.approx(
        0.01213347, rel=1e-6
    )


def test_the_peak_comes_from_the_setting_then_the_gpu_table(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert peak_flops(cpu, torch.float32, peak_tflops=2.5) == 2.5e12  # the setting wins
    names = {"NVIDIA H100 80GB HBM3": (989e12, 67e12), "NVIDIA H100 PCIe": (756e12, 51e12)}
    names |= {"NVIDIA A100-SXM4-40GB": (312e12, 19.5e12), "NVIDIA H200": (989e12, 67e12)}
    for name, (bf16, fp32) in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, n=name: n)
        assert peak_flops(cuda, torch.bfloat16) == bf16, name
        assert peak_flops(cuda, torch.float32) == fp32, name


def test_a_cpu_peak_is_measured_once(one_torch_thread):
    measured_peak_flops.cache_clear()
    torch.manual_seed(3)
    expected_draw = torch.rand(1)
    torch.manual_seed(3)
    peak = peak_flops(torch.device("cpu"), torch.float32)
    assert torch.rand(1) == expected_draw  # the run's random state is untouched
    # one thread of any CPU of this decade: between 1 GFLOP/s and 1 TFLOP/s in fp32
    assert 1e9 < peak < 1e12
    # cached: the second call measures nothing (a cache hit, not a wall-time bound, which a
    # loaded machine can miss)
    assert peak_flops(torch.device("cpu"), torch.float32) == peak
    info = measured_peak_flops.cache_info()
    assert (info.misses, info.hits) == (1, 1)


def test_the_backend_logs_mfu_of_its_update(tiny_qwen2, one_torch_thread):
    model = tiny_qwen2(0)
    n_params = sum(p.numel() for p in model.parameters())
    trainer = TorchBackend(model, TrainerConfig(peak_tflops=0.001), total_steps=10)

    def sample(ids: list[int]) -> TrainSample:
        mask = [False] * 3 + [True] * (len(ids) - 3)
        return TrainSample(ids, mask, [0.0] * len(ids), [0.0] * len(ids), 0, "g")

    m = trainer.train_step(
        [sample(list(range(1, 11))), sample(list(range(20, 32)))], SFTObjective()
    )
    # 22 tokens computed (two prompts, no shared prefix) in s = 22 / tokens_per_s seconds:
    # MFU = 6 N 22 / (s * 1e9) = 6 N tokens_per_s / 1e9
    assert m["perf/tokens"] == 22.0
    assert m["perf/mfu"] == pytest.approx(6 * n_params * m["perf/tokens_per_s"] / 1e9, rel=1e-9)
