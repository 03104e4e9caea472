"""``treadle plan`` and ``treadle simulate``: :mod:`treadle.scale` on the command line."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from treadle.scale.hardware import GIB, gpu
from treadle.scale.plan import Question, plan
from treadle.scale.shapes import resolve
from treadle.scale.simulate import Lengths, Setup, Workload, simulate


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """The options of ``command`` (plan or simulate)."""
    parser.add_argument("model", help="a named shape (llama3.1-8b, ...) or a model folder")
    parser.add_argument("--gpu", default="h100", help="GPU type (h100, h800, h20, h200, a100)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs in all")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per RL step")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-response", type=int, default=4096, help="tokens")
    parser.add_argument("--mean-response", type=float, help="tokens (default max / 3)")
    parser.add_argument("--steps", type=int, default=4, help="RL steps simulated")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    if command == "plan":
        parser.add_argument("--tp", type=int, help="training tensor-parallel degree")
        parser.add_argument("--micro-batch", type=int, default=1)
        parser.add_argument("--roles", default="policy,reference,engine")
        return
    parser.add_argument("--mode", choices=("sync", "one_step", "async"), default="sync")
    parser.add_argument("--staleness", type=float, default=1.0, help="eta, for --mode async")
    parser.add_argument("--partial", action="store_true", help="partial rollouts")
    parser.add_argument("--rollout-gpus", type=int, help="disaggregated: engines' GPUs")
    parser.add_argument("--engine-tp", type=int, default=1)
    parser.add_argument("--plot", help="write the timeline (engines and trainer) to this PNG")


def _workload(args: argparse.Namespace) -> Workload:
    mean = args.mean_response or args.max_response / 3
    return Workload(
        args.prompts, args.samples, args.prompt_tokens, Lengths(mean, args.max_response)
    )


def run(args: argparse.Namespace, console) -> int:
    """Answer ``treadle plan`` or ``treadle simulate``; raises UserError on bad input."""
    shape, g, work = resolve(args.model), gpu(args.gpu), _workload(args)
    if args.command == "plan":
        roles = tuple(r.strip() for r in args.roles.split(","))
        q = Question(shape, g, args.gpus, work, args.micro_batch, roles, tp=args.tp)
        rows = [
            {"placement": p.label, "train_peak_gib": p.train_peak / GIB,
             "step_s": p.result.step_s if p.result else None}
            for p in plan(q, steps=args.steps)
        ]  # fmt: skip
    else:
        rollout = args.rollout_gpus or args.gpus
        colocated = args.rollout_gpus is None
        setup = Setup(g, rollout, args.gpus - rollout if not colocated else args.gpus, colocated,
                      args.engine_tp, args.mode, args.staleness, args.partial)  # fmt: skip
        r = simulate(shape, work, setup, steps=args.steps)
        rows = [{k: v for k, v in asdict(r).items() if k != "timeline"}]
        if args.plot:
            from treadle.scale.plots import timeline

            console.print(f"timeline: {timeline(r, args.plot)}", markup=False)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for row in rows:
        cells = (f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
        console.print("  ".join(cells), markup=False, highlight=False, soft_wrap=True)
    return 0
