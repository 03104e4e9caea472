"""Issue 17's GPU checks, run by ``bench/gpu_h200.py`` after its own sections (or alone with
``--only issue17``): each in a child process of its own, under a time limit, so a backend that
hangs or crashes (a distributed init, a CUDA fault) costs that row only.

- ``vllm_sleep``: vLLM with ``enable_sleep_mode=True``, as colocated with a trainer: seconds of
  ``llm.sleep(level=1)`` and ``wake_up()``, GPU memory freed by the sleep (GiB, from
  ``torch.cuda.mem_get_info``), and whether greedy output is the same after waking.
- ``sglang``: treadle's SGLang engine (``rollout.engine=sglang``) if SGLang imports: rollout
  tokens/s, seconds of ``update_weights`` from the model's own tensors, and the largest gap
  between its prompt logprobs and transformers' on the same bf16 model (nats).
- ``deepspeed``, ``megatron``, ``lora``: one policy update through
  ``treadle.train.backends.build_backend`` with ``trainer.backend=deepspeed``
  (``trainer.deepspeed.zero_stage=3``), ``trainer.backend=megatron``
  (``trainer.megatron.tensor_parallel`` = the GPUs here, 1 on one H200) and LoRA
  (``model.lora.r=16``): seconds, tokens/s, peak GPU memory, trainable parameters, and the bytes
  ``named_weights()`` would sync.

A section whose package or config key is missing prints ``skipped: <why>`` instead of a row.

    python bench/gpu_sections.py SECTION --model 0.5B --folder DIR --vocab 151936 [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

import torch  # noqa: E402

SECTIONS = ("vllm_sleep", "sglang", "deepspeed", "megatron", "lora")
BACKENDS = {
    "deepspeed": ["trainer.backend=deepspeed", "trainer.deepspeed.zero_stage=3"],
    "megatron": ["trainer.backend=megatron", "trainer.megatron.tensor_parallel={gpus}"],
    "lora": ["model.lora.r=16"],
}
"""The config overrides of each backend section (``{gpus}``: the GPUs of this machine)."""
RESULT = "RESULT "


class Skip(Exception):
    """A section that cannot run here; its message says why."""


def run_all(folder: Path, name: str, vocab: int, dry_run: bool, seconds_left) -> list[dict]:
    """Every section over the saved model ``folder`` (shape ``name``, ``vocab`` tokens; the
    backends build their own random model of that shape), each in a child process
    limited to the budget left (``seconds_left()``, at most 150 s each); one row per section,
    ``{"section", "status": "ok" | "skipped: <why>", ...figures}``."""
    rows = []
    for section in SECTIONS:
        limit = min(150.0, seconds_left() - 10)
        if limit < 20:
            rows.append({"section": section, "status": "skipped: past the time budget"})
            continue
        cmd = [sys.executable, __file__, section, "--model", name, "--folder", str(folder)]
        cmd += ["--vocab", str(vocab)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        t0 = time.perf_counter()
        try:
            done = subprocess.run(
                cmd + (["--dry-run"] if dry_run else []),
                capture_output=True, text=True, timeout=limit, env=env,
            )  # fmt: skip
            row = _parse(done)
        except subprocess.TimeoutExpired:
            row = {"status": f"skipped: timed out after {limit:.0f} s"}
        rows.append({"section": section, **row})
        print(f"{section}: {row['status']} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def _parse(done: subprocess.CompletedProcess) -> dict:
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"status": f"skipped: exit {done.returncode}: {tail[0][:200]}"}


def vllm_sleep(folder: Path, vocab: int, device: torch.device) -> dict:
    if device.type != "cuda":
        raise Skip("sleep mode needs a GPU (vLLM's CPU worker ignores sleep)")
    try:
        import vllm
    except ImportError as e:
        raise Skip(f"vllm does not import ({e})") from None
    llm = vllm.LLM(
        model=str(folder), dtype="bfloat16", enforce_eager=True, enable_sleep_mode=True,
        gpu_memory_utilization=0.3, max_model_len=1024,
    )  # fmt: skip
    prompts = [{"prompt_token_ids": list(range(10 + i, 40 + i))} for i in range(8)]
    greedy = vllm.SamplingParams(temperature=0.0, max_tokens=32)

    def tokens() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]

    before = tokens()
    free0 = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    llm.sleep(level=1)  # weights to CPU memory, KV cache dropped
    sleep_s = time.perf_counter() - t0
    free1 = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    llm.wake_up()
    wake_s = time.perf_counter() - t0
    return {
        "sleep_s": sleep_s, "wake_s": wake_s, "freed_gib": (free1 - free0) / 2**30,
        "same_output_after_wake": tokens() == before,
    }  # fmt: skip


def sglang(folder: Path, vocab: int, device: torch.device) -> dict:
    from rollout_throughput import prompts_for
    from transformers import AutoModelForCausalLM

    from treadle.core.errors import UserError
    from treadle.core.protocols import EngineSpec, SamplingParams
    from treadle.rollout.engines import build_engine

    spec = EngineSpec(str(folder), dtype="bfloat16", max_model_len=1024)
    try:
        engine = build_engine("sglang", spec)
    except UserError as e:
        raise Skip(str(e)) from None
    prompts = prompts_for(vocab, 64)
    params = SamplingParams(n=1, temperature=1.0, max_tokens=64)
    engine.generate(prompts[:4], params)  # warm-up
    t0 = time.perf_counter()
    tokens = sum(len(c.token_ids) for g in engine.generate(prompts, params) for c in g)
    rate = tokens / (time.perf_counter() - t0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    t0 = time.perf_counter()
    engine.update_weights(((n, p.detach()) for n, p in model.named_parameters()), version=1)
    sync_s = time.perf_counter() - t0
    seqs = prompts[:8]
    got = engine.prompt_logprobs(seqs)
    with torch.no_grad():
        gap = 0.0
        for seq, lp in zip(seqs, got, strict=True):
            ids = torch.tensor([seq], device=device)
            ref = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            ref = ref.gather(1, ids[0, 1:, None])[:, 0].tolist()
            gap = max(gap, max(abs(a - b) for a, b in zip(lp[1:], ref, strict=True)))
    engine.close()
    return {"tokens_per_s": rate, "sync_s": sync_s, "logprob_gap_bf16": gap}


def backend(section: str, name: str, vocab: int, device: torch.device, dry_run: bool) -> dict:
    from update_phase import batch

    from treadle.config import AlgorithmConfig, load_config
    from treadle.core.errors import UserError
    from treadle.train.backends import build_backend
    from treadle.train.objectives import PolicyObjective

    gpus = max(torch.cuda.device_count(), 1)
    overrides = [o.format(gpus=gpus) for o in BACKENDS[section]]
    try:
        cfg = load_config(None, [*overrides, "trainer.lr=1e-6", "trainer.bf16_autocast=true"])
    except UserError as e:  # the backend's config keys are not in this version
        raise Skip(str(e)) from None
    from shapes import random_qwen2

    samples = batch(vocab)[: 64 if dry_run else 512]
    model = random_qwen2(name, vocab).to(device)
    total = sum(p.numel() for p in model.parameters())
    try:
        trainer = build_backend(model, cfg.trainer, 100)
    except (UserError, ImportError) as e:
        raise Skip(f"{type(e).__name__}: {e}") from None
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    if section == "lora" and trainable == total:
        raise Skip("model.lora.r loads but build_backend trained every parameter (no adapter)")
    objective = PolicyObjective.from_config(AlgorithmConfig(), 40)
    trainer.train_step(samples[:16], objective)  # warm-up
    times = []
    for _ in range(2):
        _sync(device)
        t0 = time.perf_counter()
        metrics = trainer.train_step(samples, objective)
        _sync(device)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    synced = sum(t.numel() * t.element_size() for _, t in trainer.named_weights())
    row = {
        "overrides": overrides, "update_s": seconds, "loss": float(metrics["loss"]),
        "tokens_per_s": sum(len(s) for s in samples) / seconds,
        "trainable": trainable, "parameters": total, "sync_bytes": synced,
    }  # fmt: skip
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _single_process_env(dry_run: bool) -> None:
    """A one-rank torch.distributed world (DeepSpeed and megatron-core initialise one)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):  # fmt: skip
        os.environ.setdefault(key, value)
    if dry_run:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> None:
    p = argparse.ArgumentParser(description="one issue-17 GPU section, as a child process")
    p.add_argument("section", choices=SECTIONS)
    p.add_argument("--model", required=True)
    p.add_argument("--folder", type=Path, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    try:
        if args.section == "vllm_sleep":
            row = vllm_sleep(args.folder, args.vocab, device)
        elif args.section == "sglang":
            row = sglang(args.folder, args.vocab, device)
        else:
            _single_process_env(args.dry_run)
            row = backend(args.section, args.model, args.vocab, device, args.dry_run)
        row = {"status": "ok", **row}
    except Skip as e:
        row = {"status": f"skipped: {e}"}
    print(RESULT + json.dumps(row), flush=True)
    os._exit(0)  # a distributed backend's threads must not hold the exit


if __name__ == "__main__":
    main()
