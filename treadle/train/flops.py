"""Model FLOPs utilisation (MFU) of an update: the FLOPs the model's math needs over what the
device could do in the same time.

A forward and backward pass over one token costs about ``6 N`` FLOPs for a model of ``N``
parameters (2 for the forward's multiply-add per weight, 4 for the backward's two; Kaplan et al.
2020, arXiv 2001.08361, sec. 2.1; PaLM, arXiv 2204.02311, appendix B), so an update over ``T``
tokens in ``s`` seconds on a device of peak ``P`` FLOP/s has

    MFU = 6 N T / (s P).

``N`` counts every parameter once (tied embeddings once): the LM head's matmul is real work, the
input embedding's lookup is not, and attention's ``12 L H Q T`` term (PaLM's) is left out, so
short sequences' MFU is slightly understated. Recomputed activations do not count (that is
hardware FLOPs utilisation, HFU).

The peak ``P`` is, in this order: ``trainer.peak_tflops`` when set; the dense peak of a known
GPU by ``torch.cuda.get_device_name`` (:data:`GPU_PEAK_TFLOPS`, bf16 tensor cores under
``trainer.bf16_autocast``, else plain fp32); else measured once per process, device and dtype by
timing square matmuls (:func:`measured_peak_flops`, about 0.2 s), which is what a CPU gets: its
vendor peak assumes every core's vector units busy at a clock it rarely holds.
"""

from __future__ import annotations

import functools
import time

import torch

GPU_PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    # name fragment: (bf16 dense tensor-core TFLOP/s, fp32 TFLOP/s), from the vendors' sheets;
    # the first fragment found in the device name wins, so the more specific come first
    "H200": (989.0, 67.0),
    "H100 PCIe": (756.0, 51.0),
    "H100": (989.0, 67.0),  # SXM
    "A100": (312.0, 19.5),
    "L40S": (362.0, 91.6),
    "L4": (121.0, 30.3),
    "A10G": (70.0, 31.2),
    "RTX 4090": (165.2, 82.6),
}
"""Dense peak TFLOP/s of GPUs by a fragment of ``torch.cuda.get_device_name()``."""


def model_flops_utilisation(n_params: int, tokens: int, seconds: float, peak_flops: float) -> float:
    """``6 N T / (s P)`` (see the module doc), in [0, 1] on a correct peak.

    Args:
        n_params: ``N``, the model's parameters.
        tokens: ``T``, tokens passed forward and backward (prompt and completion: every token
            of a packed sequence is computed, whether the loss counts it or not).
        seconds: wall seconds of the update.
        peak_flops: ``P``, the device's peak, FLOP/s (> 0).
    """
    return 6.0 * n_params * tokens / (max(seconds, 1e-9) * peak_flops)


def peak_flops(device: torch.device, dtype: torch.dtype, peak_tflops: float = 0.0) -> float:
    """The peak FLOP/s ``P`` of ``device`` computing in ``dtype``: ``peak_tflops`` (TFLOP/s)
    when > 0, a known GPU's from :data:`GPU_PEAK_TFLOPS`, else :func:`measured_peak_flops`."""
    if peak_tflops > 0:
        return peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, (bf16, fp32) in GPU_PEAK_TFLOPS.items():
            if fragment in name:
                return (bf16 if dtype in (torch.bfloat16, torch.float16) else fp32) * 1e12
    return measured_peak_flops(device.type, dtype)


@functools.lru_cache(maxsize=8)
def measured_peak_flops(device_type: str, dtype: torch.dtype, budget_s: float = 0.2) -> float:
    """The best FLOP/s of ``[n, n] @ [n, n]`` matmuls in ``dtype`` on ``device_type`` over about
    ``budget_s`` seconds (``2 n^3`` FLOPs each; ``n`` = 512 on CPU, 4096 on a GPU), with this
    process's torch threads; measured once per process and arguments (cached)."""
    n = 4096 if device_type == "cuda" else 512
    # a generator of its own: drawing from the global one would change the run's sampling
    rng = torch.Generator(device_type).manual_seed(0)
    a = torch.randn(n, n, device=device_type, generator=rng).to(dtype)
    b = torch.randn(n, n, device=device_type, generator=rng).to(dtype)
    best = float("inf")
    start = time.perf_counter()
    for i in range(1000):
        t0 = time.perf_counter()
        (a @ b).sum().item()  # .item(): waits for a GPU to finish
        if i > 0:  # the first call warms up (allocations, kernel selection)
            best = min(best, time.perf_counter() - t0)
        if i >= 2 and time.perf_counter() - start > budget_s:
            break
    return 2.0 * n**3 / best
