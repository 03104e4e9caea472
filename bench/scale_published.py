"""The scale model's step-time predictions beside the published figures (SCALE.md's table).

Pure arithmetic (no torch, no device): each row's setting as SCALE.md states it, the figure
the paper or README publishes, the simulator's prediction and the error.

    .venv/bin/python bench/scale_published.py
"""

from __future__ import annotations

from treadle.scale.hardware import gpu
from treadle.scale.shapes import NAMED
from treadle.scale.simulate import Lengths, Setup, Workload, simulate

AREAL = Workload(64, 16, 300, Lengths(5000, 8192, 0.8), minibatches=4)
# verl fully-async: Qwen2.5-Math-7B, DAPO, 28K max response, n=16, 512 prompts in 16 mini-batches;
# the async scripts' engine TP 4, 4 streamed updates of 128 prompts a sync and no old-logprob
# forward (use_rollout_log_probs); assumed 200-token prompts, lognormal responses (mean 1,500,
# sigma 1.0) and the colocated runs' engine TP 2 (as verl's one-step-off colocate script)
VERL_SYNC = Workload(512, 16, 200, Lengths(1500, 28672, 1.0), extra_forwards=1, minibatches=16)
VERL_ASYNC = Workload(512, 16, 200, Lengths(1500, 28672, 1.0), extra_forwards=0, minibatches=16)
# NeMo-RL v0.6 performance summary, DeepSeek-V3: GRPO 32 x 16, max sequence 1,536, average
# sequence 697-710 tokens, engines of TP 32; assumed 150-token prompts (OpenMathInstruct-2's
# problems with a chat template) and responses lognormal mean 547 (697 in all), capped at 1,386,
# a reference and an old-logprob forward
NEMO = Workload(32, 16, 150, Lengths(547, 1386, 0.8), extra_forwards=2)


def rows() -> list[tuple[str, float, float, str]]:
    """(setting, published, predicted, unit)."""
    out = []
    for eta, published in ((0, 27.1e3), (1, 47.8e3), (16, 52.0e3)):
        mode = "sync" if eta == 0 else "async"
        setup = Setup(gpu("h800"), 6, 2, mode=mode, staleness=eta, partial=eta > 0)
        r = simulate(NAMED["r1-distill-qwen-1.5b"], AREAL, setup, steps=6)
        out.append((f"AReaL 6:2 H800, staleness {eta}", published, r.tokens_per_s, "tok/s"))
    shape = NAMED["qwen2.5-math-7b"]
    for gpus, published in ((32, 790.0), (64, 365.0), (128, 356.0)):
        setup = Setup(gpu("h20"), gpus, gpus, colocated=True, engine_tp=2)
        r = simulate(shape, VERL_SYNC, setup, steps=4)
        out.append((f"verl colocated sync, {gpus} H20", published, r.step_s, "s"))
    for half, published in ((16, 295.0), (32, 189.0), (64, 151.0)):
        setup = Setup(gpu("h20"), half, half, engine_tp=4, mode="async", staleness=0.5,
                      partial=True, updates_per_sync=4)  # fmt: skip
        r = simulate(shape, VERL_ASYNC, setup, steps=5)
        out.append((f"verl fully async {half}:{half} H20", published, r.step_s, "s"))
    v3 = NAMED["deepseek-v3"]
    for gpus, published in ((512, 111.0), (256, 134.0)):
        setup = Setup(gpu("h100"), gpus, gpus, colocated=True, engine_tp=32, train_pp=16)
        r = simulate(v3, NEMO, setup, steps=4)
        out.append((f"NeMo-RL DeepSeek-V3 colocated, {gpus} H100", published, r.step_s, "s"))
    setup = Setup(gpu("h100"), 256, 256, engine_tp=32, train_pp=16, mode="one_step")
    r = simulate(v3, NEMO, setup, steps=4)
    out.append(("NeMo-RL DeepSeek-V3 one-step off-policy 256:256", 64.1, r.step_s, "s"))
    return out


def main() -> None:
    print("| setting | published | predicted | error |\n|---|---|---|---|")
    for setting, published, predicted, unit in rows():
        error = predicted / published - 1
        miss = "" if abs(error) <= 0.20 else " (missed)"
        print(f"| {setting} | {published:,.4g} {unit} | {predicted:,.4g} {unit} | "
              f"{error:+.0%}{miss} |")  # fmt: skip


if __name__ == "__main__":
    main()
