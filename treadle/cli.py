"""The ``treadle`` command.

    treadle train RECIPE [section.key=value ...] [--resume RUN_DIR]
    treadle sft RECIPE [section.key=value ...]
    treadle dpo RECIPE [section.key=value ...]
    treadle reward-check RECIPE [section.key=value ...]
    treadle serve-reward RECIPE [section.key=value ...] [--host 127.0.0.1] [--port 8900]
    treadle inspect RUN_DIR [--step N] [--limit K] [--replay] [--rollout ID]
    treadle eval MODEL_OR_RUN_DIR [RECIPE] [section.key=value ...] [--output DIR] [--overwrite]

Bad input prints one line on stderr and exits with code 2, without a traceback.
"""

from __future__ import annotations

import os

# Before torch or vLLM are imported: no hub access at run time, and one OpenMP pool sized to the
# machine (vLLM's CPU backend binds its threads at import).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
# oneDNN keeps up to 1,024 compiled matmul primitives, one per new shape, and packed batches and
# the engine's changing batch sizes bring new shapes nearly every step: the default run's peak
# resident memory grew by ~0.3 GiB over its first 8 steps with the default, ~0.1 GiB with 16,
# at the same step time (BENCHMARKS.md, "Memory per phase"). Read at oneDNN's first use, under
# its name or its older one (DNNL_); a value the user set under either is kept.
if not {"ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"} & os.environ.keys():
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "16"

import argparse
import errno
import logging
import sys
import threading
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle", description="RL post-training for LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="SFT warm-up (if sft.steps > 0), then RL, with evaluation")
    train.add_argument("recipe", nargs="?", help="YAML recipe (omit with --resume)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5")
    train.add_argument("--resume", type=Path, help="continue the run in this directory")
    sft = sub.add_parser("sft", help="supervised fine-tuning only; writes RUN/sft_model")
    sft.add_argument("recipe")
    sft.add_argument("overrides", nargs="*")
    dpo = sub.add_parser(
        "dpo", help="DPO on preference pairs against the starting model; writes RUN/dpo_model"
    )
    dpo.add_argument("recipe")
    dpo.add_argument("overrides", nargs="*")
    check = sub.add_parser(
        "reward-check",
        help="score the data's gold answers with the recipe's graders; exit 1 if any fail",
    )
    check.add_argument("recipe")
    check.add_argument("overrides", nargs="*")
    serve = sub.add_parser(
        "serve-reward", help="serve the recipe's reward functions over HTTP (POST /score)"
    )
    serve.add_argument("recipe")
    serve.add_argument("overrides", nargs="*")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    serve.add_argument("--port", type=int, default=8900)
    inspect = sub.add_parser(
        "inspect", help="print a step's rollouts from RUN/buffer; --replay recomputes its update"
    )
    inspect.add_argument("run_dir", type=Path)
    inspect.add_argument("--step", type=int, help="the RL step (default: the last stored)")
    inspect.add_argument("--limit", type=_positive, default=32, help="rollouts to print")
    inspect.add_argument(
        "--replay", action="store_true", help="recompute the step's loss and weights from disk"
    )
    inspect.add_argument(
        "--rollout", help="print this rollout id turn by turn, with what is trained marked"
    )
    evaluate = sub.add_parser(
        "eval",
        help="pass@k, greedy accuracy and per-sample outputs of a model on a recipe's data",
        description="Evaluate a model folder, or a run directory's final_model (its config.yaml "
        "is then the default recipe), on the recipe's held-out split (eval.split=held_out) or "
        "every row of its data files (eval.split=all). Example: treadle eval "
        "runs/default/final_model recipes/eval/math500.yaml eval.samples_per_prompt=4",
    )
    evaluate.add_argument("target", type=Path, help="model folder or run directory")
    evaluate.add_argument("recipe", nargs="?", help="YAML recipe (default: the run's config)")
    evaluate.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.k=[1,4]")
    evaluate.add_argument("--output", type=Path, help="output folder (default: RUN/eval/NAME)")
    evaluate.add_argument(
        "--overwrite", action="store_true", help="replace an existing output folder"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``treadle`` command; returns the process exit status.

    0 on success, 2 on a :class:`~treadle.core.errors.UserError` (printed to stderr), 143 on
    SIGTERM and 130 on SIGINT (Ctrl-C): a run stops after its step, checkpointed. ``argv``
    defaults to ``sys.argv[1:]``.
    """
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import transformers

    # Our own progress bars report the run; transformers' per-save/load bars only add noise.
    transformers.utils.logging.disable_progress_bar()
    from treadle.core.errors import UserError
    from treadle.jobs.stopping import Stopped, stop_on_signal

    threading.excepthook = _quiet_disk_full(threading.excepthook)
    try:
        with stop_on_signal():  # SIGTERM stops any command at once; train waits for its step
            return _run(args)
    except UserError as e:
        print(f"treadle: error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"treadle: {_stopped(e, args)}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # Any write of the run (metrics, buffer, samples): all are atomic or appended whole.
        print(
            f"treadle: error: disk full writing {e.filename or 'the run directory'} ({e.strerror});"
            " free space and continue with treadle train --resume RUN_DIR: the last checkpoint "
            "is intact",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(
            "treadle: interrupted; nothing on disk is half-written: treadle train --resume "
            "RUN_DIR continues from the last checkpoint (an interrupted SFT warm-up starts again)",
            file=sys.stderr,
        )
        return 130


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from treadle.config import load_config
    from treadle.core.errors import UserError

    console = Console()
    if args.command == "inspect":
        # Piped to a file or a pager, rich would wrap the table at 80 columns.
        return _inspect(args, console if console.is_terminal else Console(width=160))
    if args.command == "eval":
        return _eval(args, console)
    recipe = args.recipe
    overrides = list(args.overrides)
    if args.command == "train" and args.resume is not None:
        recipe = args.resume / "config.yaml"
        if not recipe.is_file():
            raise UserError(f"--resume {args.resume}: not a treadle run directory (no config.yaml)")
        if args.recipe and "=" not in args.recipe:
            raise UserError(
                "train: give a recipe or --resume RUN_DIR, not both (a resumed run uses its "
                "own config.yaml; overrides such as run.steps=80 still apply)"
            )
        if args.recipe:  # argparse took the first override for the recipe
            overrides = [args.recipe, *overrides]
    if recipe is None:
        raise UserError("train: pass a recipe, e.g. treadle train recipes/default.yaml")
    cfg = load_config(recipe, overrides)
    if args.command == "sft":
        from treadle.jobs.sft import sft_only

        folder = sft_only(cfg, console)
        console.print(
            f"SFT checkpoint: {folder}; start RL from it with model.path={folder} sft.steps=0"
        )
        return 0
    if args.command == "serve-reward":
        import uvicorn

        from treadle.rewards.pool import RewardPool
        from treadle.rewards.service import build_app

        console.print(f"serving reward functions on http://{args.host}:{args.port}/score")
        uvicorn.run(build_app(RewardPool.from_config(cfg.reward)), host=args.host, port=args.port)
        return 0
    if args.command == "reward-check":
        from treadle.jobs.reward_check import check_gold, report

        result = check_gold(cfg)
        report(result, console)
        return 1 if result.failures else 0
    if args.command == "dpo":
        from treadle.jobs.dpo import run_dpo

        folder = run_dpo(cfg, console)
        console.print(f"DPO model: {folder} (held-out summary: dpo_summary.json beside it)")
        return 0
    from treadle.jobs.train import train

    train(cfg, resume=args.resume, console=console)
    return 0


def _quiet_disk_full(default):
    """A ``threading.excepthook`` that prints nothing for a full disk in a background writer
    (TensorBoard's): the main thread meets the same error on its next write and reports it
    in one line. Any other error keeps ``default``'s traceback."""

    def hook(args: threading.ExceptHookArgs) -> None:
        """Skip ENOSPC/EDQUOT, hand the rest to ``default``."""
        if isinstance(args.exc_value, OSError) and args.exc_value.errno in (
            errno.ENOSPC,
            errno.EDQUOT,
        ):
            return
        default(args)

    return hook


def _stopped(stop, args: argparse.Namespace) -> str:
    """The one line printed when a run stops on a signal: where it stopped, how to resume."""
    where = f"after step {stop.step}" if stop.step is not None else "at once"
    saved = f", checkpoint {stop.checkpoint.name} saved" if stop.checkpoint else ""
    if args.command != "train":
        return f"stopped by {stop.name} {where}; nothing on disk is half-written"
    run_dir = stop.run_dir or args.resume
    if run_dir is None or not (Path(run_dir) / "config.yaml").exists():
        return f"stopped by {stop.name} {where}, before the run began; run the command again"
    return (
        f"stopped by {stop.name} {where}{saved}; continue with: treadle train --resume {run_dir} "
        "(from the last checkpoint; nothing on disk is half-written)"
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _eval(args: argparse.Namespace, console) -> int:
    from treadle.jobs.evaluate_job import default_output, eval_config, resolve_target, run_eval

    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:  # argparse took the first override for the recipe
        recipe, overrides = None, [recipe, *overrides]
    target = resolve_target(args.target)
    cfg = eval_config(target, recipe, overrides)
    output = args.output or default_output(target, recipe, cfg)
    run_eval(target, cfg, output, overwrite=args.overwrite, console=console)
    return 0


def _inspect(args: argparse.Namespace, console) -> int:
    from treadle.jobs.inspect_run import open_run, print_rollout, print_step, replay_step

    _, buffer = open_run(args.run_dir)
    steps = buffer.steps()
    if not steps:
        from treadle.core.errors import UserError

        raise UserError(f"inspect {args.run_dir}: the buffer holds no step yet")
    step = steps[-1] if args.step is None else args.step
    if args.rollout is not None:
        print_rollout(args.run_dir, step, args.rollout, console)
        return 0
    print_step(args.run_dir, step, console, limit=args.limit)
    if args.replay:
        r = replay_step(args.run_dir, step)
        logged = "not logged" if r.logged_loss is None else f"{r.logged_loss:.8g}"
        console.print(f"replay of step {step}: loss {r.replayed_loss:.8g} (logged: {logged})")
        if r.max_param_diff is None:
            console.print("the checkpoint after the step is not kept: weights not compared")
        else:
            console.print(f"max |replayed - checkpointed| parameter: {r.max_param_diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
