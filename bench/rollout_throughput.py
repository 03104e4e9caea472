"""Rollout throughput: new tokens per second of treadle's engine path (vLLM, in process) against
transformers ``generate`` on the same model, prompts and sampling settings, in one run.

    OMP_NUM_THREADS=2 .venv/bin/python bench/rollout_throughput.py [--sizes 0.5M,3M,25M,0.5B]
        [--dtypes float32,bfloat16] [--prompts 64] [--new-tokens 64] [--reps 3] [--append]

treadle's side is its vLLM engine in a process of its own (``EngineProcess``, the engine of the
asynchronous modes) with the libraries treadle preloads there (tcmalloc and Intel OpenMP, where
``scripts/install.sh`` put them: :mod:`treadle.rollout.engines.choice`); transformers runs in
this process as a user writes it. Each row says what ``rollout.engine=auto`` and
``rollout.dtype=auto`` pick for that model on this CPU, and the table's environment line names
the CPU's instruction sets (BENCHMARKS.md keeps one table per kind of CPU).

Each size is a Qwen2-shape model with random weights (0.5B: the Qwen2.5-0.5B shape with the
real Qwen3 tokenizer from ../shared/data; that size is skipped without it). Both sides get the
same 64 prompts of 24-40 random tokens and sample at temperature 1 with no top-k/top-p cut, up to
``--new-tokens`` (random weights rarely emit the end token; every token produced counts, up to
and including an end token). Runs alternate (treadle, HF, treadle, HF, ...) after one warm-up
each; the median tokens/s of each side and their ratio are printed
as a markdown row and written to ``bench/rollout_throughput.json``.
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

import report
import torch
from shapes import random_qwen2

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers" / "qwen3"
VOCAB = {"0.5M": 2048, "3M": 4096, "25M": 16384, "0.5B": None}  # None: the Qwen3 tokenizer's


def build(name: str, folder: Path) -> int:
    from transformers import AutoTokenizer

    from treadle.store.models import build_tokenizer

    vocab = VOCAB[name]
    if vocab is None:
        tokenizer = AutoTokenizer.from_pretrained(SHARED)
    else:
        tokenizer = build_tokenizer([f"w{i} {i}" for i in range(vocab)], vocab)
    model = random_qwen2(name, len(tokenizer), 1024, tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def prompts_for(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(24, 41, (count,), generator=g).tolist()
    return [torch.randint(10, vocab - 10, (n,), generator=g).tolist() for n in lengths]


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad: int, eos: int) -> int:
    """What a transformers user writes: left-padded batch, sampling, ``generate``; returns the
    tokens produced (each row up to its first end token)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            pad_token_id=pad,
        )
    new = out[:, width:].tolist()
    return sum(row.index(eos) + 1 if eos in row else len(row) for row in new)


def auto_picks(params: int) -> str:
    """What ``rollout.engine=auto`` and ``rollout.dtype=auto`` choose for a sync run of a model
    of ``params`` parameters on this machine."""
    from treadle.config import load_config
    from treadle.core.cpu import detect
    from treadle.rollout.engines.choice import choose

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "default.yaml"
    cfg = load_config(recipe, ["rollout.engine=auto", "rollout.dtype=auto"])
    choice = choose(cfg, params, detect(), torch.cuda.is_available())
    return f"{choice.engine}, {choice.dtype}"


def measure(name: str, dtype: str, args, tmp: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from treadle.core.protocols import EngineSpec, SamplingParams
    from treadle.rollout.engines.choice import preload_libraries
    from treadle.rollout.engines.engine_process import EngineProcess
    from treadle.store.models import parameter_count

    folder = tmp / name  # built once, for the first dtype
    params = parameter_count(folder) if folder.exists() else build(name, folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    vocab = model.config.vocab_size
    prompts = prompts_for(vocab, args.prompts)
    preload, _ = preload_libraries()
    spec = EngineSpec(str(folder), dtype=dtype, max_model_len=1024, kv_cache_gib=2)
    engine = EngineProcess("vllm", spec, (), preload)
    sampling = SamplingParams(n=1, temperature=1.0, max_tokens=args.new_tokens, seed=None)

    def ours() -> int:
        return sum(len(c.token_ids) for g in engine.generate(prompts, sampling) for c in g)

    def theirs() -> int:
        config = model.config
        return hf_generate(
            model, prompts, args.new_tokens, config.pad_token_id, config.eos_token_id
        )

    rates: dict[str, list[float]] = {"treadle": [], "hf_generate": []}
    for fn in (ours, theirs):
        fn()  # warm-up
    for _ in range(args.reps):
        for label, fn in (("treadle", ours), ("hf_generate", theirs)):
            t0 = time.perf_counter()
            tokens = fn()
            rates[label].append(tokens / (time.perf_counter() - t0))
    engine.close()
    row = {
        "model": name,
        "dtype": dtype,
        "parameters": params,
        "preload": [Path(p).name for p in preload],
        "auto": auto_picks(params),
        **{k: statistics.median(v) for k, v in rates.items()},
    }
    row["runs"] = rates
    row["ratio"] = row["treadle"] / row["hf_generate"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="0.5M,3M,25M,0.5B")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    report.add_append_flag(parser)
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sizes.split(","):
            if VOCAB[name] is None and not SHARED.exists():
                print(f"skipping {name}: needs the Qwen3 tokenizer in {SHARED}", file=sys.stderr)
                continue
            for dtype in args.dtypes.split(","):
                rows.append(measure(name, dtype, args, Path(tmp)))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    header = ["model", "params", "dtype", "treadle (vLLM) tok/s", "transformers generate tok/s",
              "ratio", "preloaded", "auto picks"]  # fmt: skip
    lines = [
        [r["model"], f"{r['parameters'] / 1e6:.1f}M", r["dtype"], f"{r['treadle']:.0f}",
         f"{r['hf_generate']:.0f}", f"{r['ratio']:.2f}x", ", ".join(r["preload"]) or "-",
         r["auto"]]
        for r in rows
    ]  # fmt: skip
    md = (
        f"{args.prompts} prompts x {args.new_tokens} new tokens, sampling at T=1; median of "
        f"{args.reps} alternating runs\n\n" + report.table(header, lines)
    )
    out = {"args": vars(args), "rows": rows}
    report.emit(
        "Rollout throughput", md, out, Path(__file__).with_suffix(".json"), append=args.append
    )


if __name__ == "__main__":
    main()
