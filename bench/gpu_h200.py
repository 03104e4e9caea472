"""Issue 6's benchmarks a, c, d, e on one GPU (an H200), in one command under 8 minutes.

    # on the GPU machine (its image has torch and transformers; treadle's other needs travel as
    # wheels in .whl: pebble, and vllm with its dependencies for the vLLM rows):
    PYTHONUNBUFFERED=1 python3 bench/gpu_h200.py [--sizes 0.5B,1.5B] [--budget-s 420]
    # the same code on this CPU, tiny shapes, as a dry run before spending device time:
    OMP_NUM_THREADS=2 .venv/bin/python bench/gpu_h200.py --dry-run

Models: Qwen2-shape, random weights, bf16 (0.5B = Qwen2.5-0.5B, 1.5B = Qwen2.5-1.5B: vocab
151,936, tied embeddings); the dry run uses the 0.5M and 3M shapes on the CPU.

- a. Rollout: new tokens/s of treadle's engine path against transformers ``generate`` on the
  same model: 64 prompts of 24-40 random tokens, 64 new tokens, temperature 1. treadle's path
  is vLLM when it imports, else its transformers engine (the row says which).
- c. Update: one policy update of the default-shaped batch (512 samples, 64 prompts x 8
  completions, shared prompts) by treadle's TorchBackend with bf16 autocast; tokens/s and model
  FLOP/s (as bench/update_phase.py counts them) against the bf16 matmul peak measured here
  (8192^3 ``torch.mm``) and the H200's 790 TFLOP/s.
- d. Padding: computed tokens that are real (packed) against padding the same micro-batches.
- e. Colocated sync: seconds and GB/s for the engine to load the trainer's bf16 weights in
  process (``update_weights``), against a device ``copy_`` of the same bytes.

Then issue 17's checks (:mod:`gpu_sections`) on the first size, each in a child process:
vLLM sleep/wake for colocation, SGLang if it imports, and one update each through the
DeepSpeed ZeRO-3, Megatron-core and LoRA backends; a missing one prints ``skipped: <why>``.
``--only issue6`` or ``--only issue17`` runs one part (issue 17's alone: about 5 minutes).

Each section checks the time budget first and is skipped (saying so) past it, so the command
ends well inside the device's 10-minute limit. Results: a markdown table on stdout and
``bench/gpu_h200.json`` (also ``$OUT/gpu_h200.json`` when ``OUT`` is set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]  # treadle need not be installed there

import gpu_sections  # noqa: E402
import report  # noqa: E402
import torch  # noqa: E402
from rollout_throughput import hf_generate, prompts_for  # noqa: E402
from shapes import random_qwen2  # noqa: E402
from update_phase import batch, matmul_peak, model_flops, padding  # noqa: E402

H200_BF16_PEAK = 790e12  # FLOP/s, dense bf16 (measured 769-798 on these machines)
VOCAB = {"0.5M": 2048, "3M": 4096, "0.5B": 151936, "1.5B": 151936}


class Clock:
    def __init__(self, budget_s: float):
        self.start, self.budget = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def save_model(name: str, folder: Path) -> int:
    from treadle.store.models import build_tokenizer

    # A small real tokenizer for the engines; the model's vocabulary is the size's own (token
    # ids past the tokenizer's are still valid model inputs and outputs).
    tokenizer = build_tokenizer([f"w{i} {i}" for i in range(512)], 512)
    model = random_qwen2(name, VOCAB[name], 1024, tokenizer).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def engine_for(folder: Path):
    from treadle.core.protocols import EngineSpec
    from treadle.rollout.engines import build_engine

    spec = EngineSpec(str(folder), dtype="bfloat16", max_model_len=1024, kv_cache_gib=8)
    try:
        import vllm  # noqa: F401

        return "vllm", build_engine("vllm", spec)
    except ImportError:
        return "transformers", build_engine("hf", spec)


def rollout(name, folder, device, args) -> dict:
    from transformers import AutoModelForCausalLM

    from treadle.core.protocols import SamplingParams

    label, engine = engine_for(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    prompts = prompts_for(VOCAB[name], 64)
    sampling = SamplingParams(n=1, temperature=1.0, max_tokens=args.new_tokens)
    cfg = model.config

    def ours() -> int:
        return sum(len(c.token_ids) for g in engine.generate(prompts, sampling) for c in g)

    def theirs() -> int:
        ids = [[min(t, cfg.vocab_size - 1) for t in p] for p in prompts]
        return hf_generate(model, ids, args.new_tokens, cfg.pad_token_id, cfg.eos_token_id)

    ours(), theirs()  # warm-up
    rates: dict[str, list[float]] = {"treadle": [], "hf": []}
    for _ in range(args.reps):
        for key, fn in (("treadle", ours), ("hf", theirs)):
            sync(device)
            t0 = time.perf_counter()
            tokens = fn()
            sync(device)
            rates[key].append(tokens / (time.perf_counter() - t0))
    row = {"engine": label, **{k: statistics.median(v) for k, v in rates.items()}}
    row["ratio"] = row["treadle"] / row["hf"]

    # e. colocated sync: the engine loads the trainer's weights in process.
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    size = sum(t.numel() * t.element_size() for t in weights.values())
    times = []
    for version in range(1, args.reps + 2):
        sync(device)
        t0 = time.perf_counter()
        engine.update_weights(iter(weights.items()), version=version)
        sync(device)
        times.append(time.perf_counter() - t0)
    flat = torch.cat([t.reshape(-1) for t in weights.values()])
    copy_times = []
    target = torch.empty_like(flat)
    for _ in range(args.reps + 1):
        sync(device)
        t0 = time.perf_counter()
        target.copy_(flat)
        sync(device)
        copy_times.append(time.perf_counter() - t0)
    row["sync_s"] = statistics.median(times[1:])
    row["sync_gb_s"] = size / row["sync_s"] / 1e9
    row["copy_gb_s"] = size / statistics.median(copy_times[1:]) / 1e9
    engine.close()
    return row


def update(name, device, args) -> dict:
    from treadle.config import AlgorithmConfig, TrainerConfig
    from treadle.train.objectives import PolicyObjective
    from treadle.train.torch_backend import TorchBackend

    samples = batch(VOCAB[name])
    model = random_qwen2(name, VOCAB[name]).to(device)
    trainer = TrainerConfig(lr=1e-6, micro_batch_tokens=args.micro_batch_tokens, bf16_autocast=True)
    backend = TorchBackend(model, trainer, 100)
    objective = PolicyObjective.from_config(AlgorithmConfig(), 40)
    backend.train_step(samples[:64], objective)  # warm-up
    times = []
    for _ in range(args.reps):
        sync(device)
        t0 = time.perf_counter()
        backend.train_step(samples, objective)
        sync(device)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    micro = backend._micro_batches(samples)
    flops = model_flops(model, micro) / seconds
    packed, padded = padding(samples, args.micro_batch_tokens)
    row = {
        "update_s": seconds,
        "tokens_per_s": sum(len(s) for s in samples) / seconds,
        "flops_per_s": flops,
        "computed_tokens": sum(mb.num_tokens for mb in micro),
        "packed_real_share": packed,
        "padded_real_share": padded,
    }
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def issue17_rows(name: str, tmp: Path, args, clock: Clock) -> list[dict]:
    """Issue 17's checks (:func:`gpu_sections.run_all`) on the model ``name``, saved once."""
    folder = tmp / name
    if not (folder / "config.json").exists():
        save_model(name, folder)
    return gpu_sections.run_all(folder, name, VOCAB[name], args.dry_run, clock.left)


def _figures(row: dict) -> str:
    """A row's figures, ``key=value`` with 3 significant digits, for the table."""
    skip = ("section", "status", "overrides")
    return ", ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in row.items()
        if k not in skip
    )


def tables(rows: list[dict], issue17: list[dict], skipped: list[str], peak: float, args) -> str:
    """The markdown of the results: issue 6's table, issue 17's checks, what was skipped."""
    ref = peak if args.dry_run else H200_BF16_PEAK
    header = [
        "model", "engine", "rollout tok/s: treadle / generate (ratio)", "update tok/s",
        "update TFLOP/s (% measured peak, % 790)", "real tokens packed / padded",
        "sync GB/s (copy GB/s, share)",
    ]  # fmt: skip
    lines = []
    for r in rows:
        f = r.get("flops_per_s")
        rollout_cell = "skipped"
        if "ratio" in r:
            rollout_cell = f"{r['treadle']:.0f} / {r['hf']:.0f} ({r['ratio']:.2f}x)"
        sync_cell = "skipped"
        if "sync_gb_s" in r:
            share = 100 * r["sync_gb_s"] / r["copy_gb_s"]
            sync_cell = f"{r['sync_gb_s']:.1f} ({r['copy_gb_s']:.1f}, {share:.0f}%)"
        update_cells = ["skipped", "skipped", "-"]
        if f:
            update_cells = [
                f"{r['tokens_per_s']:.0f}",
                f"{f / 1e12:.2f} ({100 * f / peak:.0f}%, {100 * f / ref:.0f}%)",
                f"{100 * r['packed_real_share']:.0f}% / {100 * r['padded_real_share']:.0f}%",
            ]
        lines.append([r["model"], r.get("engine", "-"), rollout_cell, *update_cells, sync_cell])
    md = report.table(header, lines) if rows else ""
    if issue17:
        md += "\n\n" + report.table(
            ["issue 17 check", "status", "figures"],
            [[r["section"], r["status"], _figures(r)] for r in issue17],
        )
    if skipped:
        md += f"\n\nSkipped past the {args.budget_s:.0f} s budget: {', '.join(skipped)}"
    return md


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--sizes", default=None, help="default 0.5B,1.5B (dry run: 0.5M,3M)")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting sections after")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--only", choices=("issue6", "issue17"), default=None, help="one part only")
    report.add_append_flag(p)
    args = p.parse_args()
    clock = Clock(args.budget_s)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.dry_run:
        sys.exit("no CUDA device: run with --dry-run for the CPU rehearsal")
    sizes = (args.sizes or ("0.5M,3M" if args.dry_run else "0.5B,1.5B")).split(",")
    if args.dry_run:
        args.micro_batch_tokens, args.new_tokens, args.reps = 4096, 16, 2
    peak = matmul_peak(torch.bfloat16, 2048 if args.dry_run else 8192, 10, device.type)
    print(f"{device}: bf16 matmul peak {peak / 1e12:.1f} TFLOP/s", flush=True)
    rows, skipped = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in sizes if args.only != "issue17" else ():
            row: dict = {"model": name}
            for section in ("rollout", "update"):
                if clock.left() < 30:
                    skipped.append(f"{name} {section}")
                    continue
                t0 = time.perf_counter()
                if section == "rollout":
                    folder = Path(tmp) / name
                    row["parameters"] = save_model(name, folder)
                    row |= rollout(name, folder, device, args)
                else:
                    row |= update(name, device, args)
                print(f"{name} {section}: {time.perf_counter() - t0:.0f} s", flush=True)
            rows.append(row)
        issue17 = [] if args.only == "issue6" else issue17_rows(sizes[0], Path(tmp), args, clock)
    md = tables(rows, issue17, skipped, peak, args)
    results = {"args": vars(args), "device": str(device), "peak": peak, "rows": rows}
    results["issue17"] = issue17
    if device.type == "cuda":
        title, path = "GPU (H200)", Path(__file__).with_suffix(".json")
    else:  # a rehearsal, not a result: kept out of the committed figures
        title, path = "GPU script, CPU dry run", ROOT / "bench" / "out" / "gpu_h200_dry_run.json"
        path.parent.mkdir(parents=True, exist_ok=True)
    report.emit(title, md, results, path, append=args.append)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_h200.json").write_text(json.dumps(results, indent=1))
    print(f"total {time.perf_counter() - clock.start:.0f} s")


if __name__ == "__main__":
    main()
