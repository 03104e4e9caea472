"""The ``treadle`` command.

    treadle train RECIPE [section.key=value ...] [--resume RUN_DIR]
    treadle sft RECIPE [section.key=value ...]
    treadle dpo RECIPE [section.key=value ...]
    treadle reward-check RECIPE [section.key=value ...]
    treadle serve-reward RECIPE [section.key=value ...] [--host 127.0.0.1] [--port 8900]
    treadle inspect RUN_DIR [--step N] [--limit K] [--replay] [--rollout ID]
    treadle eval MODEL_OR_RUN_DIR [RECIPE] [section.key=value ...] [--output DIR] [--overwrite]
    treadle config [SECTION | KEY]

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
import contextlib
import errno
import logging
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any


class _Parser(argparse.ArgumentParser):
    """argparse with treadle's one-line errors: ``treadle: error: ...`` naming the help to
    read, exit 2, no usage block."""

    def error(self, message: str):
        command = self.prog.removeprefix("treadle").strip()
        self.exit(2, f"treadle: error: {_cut(message)} (treadle "
                     f"{command + ' ' if command else ''}--help lists the options)\n")  # fmt: skip


def _cut(text: str) -> str:
    """``text`` as one short line (:func:`~treadle.core.errors.one_line`), a word longer than 240
    characters (a value pasted whole into a flag) cut to its first 160 and last 60 around an
    ellipsis, and a line still over 1,200 characters (a long value with spaces) cut to its
    first 600 and last 400, where the fix is."""
    from treadle.core.errors import one_line

    text = re.sub(r"\S{241,}", lambda m: f"{m[0][:160]}…{m[0][-60:]}", one_line(text))
    return text if len(text) <= 1200 else f"{text[:600]} … {text[-400:]}"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="treadle",
        description="RL post-training for LLMs",
        epilog="treadle COMMAND --help: what a command reads and writes, with an example. "
        "treadle config: every config key with its type, default and meaning.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parser.commands = sub.choices  # each command's parser, to name its --help in an error
    train = sub.add_parser("train", **_about("train"))
    train.add_argument("recipe", nargs="?", help="YAML recipe (omit with --resume)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5")
    train.add_argument(
        "--resume", type=Path, metavar="RUN_DIR", help="continue the run in this directory"
    )
    for command in ("sft", "dpo", "reward-check", "serve-reward"):  # RECIPE [overrides]
        recipe_job = sub.add_parser(command, **_about(command))
        recipe_job.add_argument("recipe", help="YAML recipe (every key: treadle config)")
        recipe_job.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.size=500")
    serve = recipe_job  # serve-reward's own options
    serve.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    serve.add_argument("--port", type=int, default=8900)
    inspect = sub.add_parser("inspect", **_about("inspect"))
    inspect.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="e.g. runs/default")
    inspect.add_argument("--step", type=int, help="the RL step (default: the last stored)")
    inspect.add_argument("--limit", type=_positive, default=32, help="rollouts to print")
    inspect.add_argument(
        "--replay", action="store_true", help="recompute the step's loss and weights from disk"
    )
    inspect.add_argument(
        "--rollout", help="print this rollout id turn by turn, with what is trained marked"
    )
    evaluate = sub.add_parser("eval", **_about("eval"))
    evaluate.add_argument("target", type=Path, help="model folder or run directory")
    evaluate.add_argument("recipe", nargs="?", help="YAML recipe (default: the run's config)")
    evaluate.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.k=[1,4]")
    evaluate.add_argument("--output", type=Path, help="output folder (default: RUN/eval/NAME)")
    evaluate.add_argument(
        "--overwrite", action="store_true", help="replace an existing output folder"
    )
    from treadle.jobs.scale_args import add_arguments

    for command in ("plan", "simulate"):
        add_arguments(sub.add_parser(command, **_about(command)), command)
    config = sub.add_parser("config", **_about("config"))
    config.add_argument(
        "section", nargs="?", help="a section (rollout, algorithm.kl, data.mix) or one key"
    )
    return parser


_RUN = "RUN_DIR is run.output_dir/run.name (runs/default for the default recipe)."
_ABOUT = {
    "train": (
        "SFT warm-up (if sft.steps > 0), then RL, with evaluation",
        "Train a policy. Builds or loads the model (model.path, or a small model built from "
        "model.tiny) and the data (data.*), runs the SFT warm-up when sft.steps > 0, then "
        "run.steps RL steps (generate, score, update, sync weights), evaluating held-out "
        "accuracy before RL, every eval.every steps and after RL.\n\n"
        "Reads the RECIPE (YAML, with its base: recipe; every key: treadle config), the "
        "dotted overrides, model.path and data.path. Writes RUN_DIR: config.yaml, "
        "metrics.jsonl, tensorboard/, samples/, buffer/, checkpoints/, base_model/ (a built "
        "model), sft_model/, before_rl.json, final_model/, summary.json, plot.png, engine.log "
        f"(the engine's start-up output). {_RUN} --resume RUN_DIR continues from its "
        "last checkpoint.",
        "treadle train recipes/default.yaml\n"
        "  treadle train recipes/default.yaml trainer.lr=1e-5 rollout.n=4 run.name=lr1e-5\n"
        "  treadle train --resume runs/default run.steps=80",
    ),
    "sft": (
        "supervised fine-tuning only; writes RUN/sft_model",
        "Supervised fine-tuning only: the SFT warm-up of train (sft.steps steps on the data's "
        "demonstrations, written with data.answer_template), without RL.\n\n"
        "Reads the RECIPE, model.path and the data. Writes RUN_DIR/sft_model (Hugging Face "
        f"format) and its metrics under RUN_DIR/sft/. {_RUN}",
        "treadle sft recipes/default.yaml sft.steps=200\n"
        "  treadle train recipes/default.yaml model.path=runs/default/sft_model sft.steps=0 "
        "run.name=rl",
    ),
    "dpo": (
        "DPO on preference pairs against the starting model; writes RUN/dpo_model",
        "Direct Preference Optimization (arXiv 2305.18290) on pairs of a chosen and a rejected "
        "response: the jsonl file dpo.path, or pairs made from the reasoning-gym data; the "
        "starting model is the frozen reference.\n\n"
        "Reads the RECIPE, model.path and dpo.path. Writes RUN_DIR/dpo_model (Hugging Face "
        f"format) and the held-out summary dpo_summary.json beside it. {_RUN}",
        "treadle dpo recipes/dpo.yaml dpo.path=pairs.jsonl dpo.beta=0.1 dpo.steps=200",
    ),
    "reward-check": (
        "score the data's gold answers with the recipe's graders; exit 1 if any fail",
        "Check data and graders before training: the data's gold answers are scored by the "
        "recipe's reward functions (reward.functions), as a training step would score "
        "completions. Prints the failures; exit status 1 when any gold answer fails.\n\n"
        "Reads the RECIPE and its data. Writes nothing.",
        "treadle reward-check recipes/default.yaml data.source=jsonl data.path=gsm8k.jsonl "
        "data.reasoning=none reward.functions='[{name: math_verify}]'",
    ),
    "serve-reward": (
        "serve the recipe's reward functions over HTTP (POST /score)",
        "Serve the recipe's reward functions (reward.functions) over HTTP, so that training "
        "runs elsewhere score with them: POST /score with samples returns their scores. A "
        "training recipe uses it with reward.functions='[{name: remote, params: {url: "
        '"http://HOST:PORT"}}]\'.\n\n'
        "Reads the RECIPE. Writes nothing; serves until stopped (Ctrl-C).",
        "treadle serve-reward recipes/default.yaml --host 127.0.0.1 --port 8900",
    ),
    "inspect": (
        "print a step's rollouts from RUN/buffer; --replay recomputes its update",
        "Look at what a run trained on: a step's prompts, completions, rewards and advantages "
        "from RUN_DIR/buffer/. --rollout ID prints one rollout turn by turn with the trained "
        "tokens marked; --replay recomputes the step's update from the buffer, the checkpoint "
        "before the step and config.yaml, and prints its loss beside the logged one.\n\n"
        "Reads RUN_DIR. Writes nothing.",
        "treadle inspect runs/default --limit 8\n  treadle inspect runs/default --step 41 --replay",
    ),
    "eval": (
        "pass@k, greedy accuracy and per-sample outputs of a model on a recipe's data",
        "Evaluate a model folder, or a run directory's final_model (its config.yaml is then "
        "the default recipe), on the recipe's held-out split (eval.split=held_out) or on every "
        "row of its data files (eval.split=all): pass@k for each k of eval.k (the unbiased "
        "estimator of Chen et al. 2021), greedy accuracy, at eval.temperature with "
        "eval.samples_per_prompt samples per prompt, seeded with run.seed.\n\n"
        "Reads the model (config.json, weights, tokenizer), the RECIPE and data.path. Writes "
        "the output folder (default RUN_DIR/eval/RECIPE_NAME for a model in a run directory, "
        "else run.output_dir/eval/MODEL-RECIPE_NAME): samples.jsonl (one line per completion), "
        "summary.json, config.yaml and engine.log; an existing one is refused "
        "unless --overwrite.",
        "treadle eval runs/default\n"
        "  treadle eval runs/default/final_model recipes/eval/math500.yaml eval.k=[1,4]\n"
        "  treadle eval runs/default recipes/eval/gsm8k.yaml --output gsm8k_eval",
    ),
    "plan": (
        "memory per GPU and role, and the placements that fit, most tokens per second first",
        "Plan a run on paper: for MODEL (a named shape or a model folder's config.json) on "
        "--gpus GPUs of --gpu type, the colocated and disaggregated placements of the roles "
        "that fit in memory, ranked by simulated trained tokens per second (SCALE.md).\n\n"
        "Reads MODEL's config.json (and --lengths-from RUN_DIR's buffer and config.yaml). "
        "Writes nothing but --plot's PNG.",
        "treadle plan qwen2.5-7b --gpu h100 --gpus 8 --max-response 8192 --plot memory.png",
    ),
    "simulate": (
        "simulate RL steps: step time, throughput, busy fractions, staleness",
        "Simulate RL steps event by event (engines decoding with a KV-limited batch, "
        "preempting where it fills, training at the GPU's MFU, weight sync) in sync, one_step "
        "or async mode (SCALE.md). `bench/scale_published.py --commands` prints the commands "
        "of SCALE.md's published rows.\n\nReads MODEL's config.json (and --lengths-from "
        "RUN_DIR's buffer and config.yaml). Writes nothing but --plot's PNG.",
        "treadle simulate r1-distill-qwen-1.5b --gpu h800 --gpus 8 --rollout-gpus 6 "
        "--mode async --staleness 1 --partial --plot timeline.png\n"
        "  treadle simulate qwen2.5-0.5b --lengths-from runs/default --gpus 2",
    ),
    "config": (
        "list the config keys with their type, default and meaning",
        "List the keys a recipe or an override may set, each with its type, default and "
        "meaning (the docstrings of treadle/config/). SECTION lists one section and its "
        "subsections (rollout, algorithm.kl, data.mix); a key prints its whole description. "
        "An unknown name gets a did-you-mean, TRL's and verl's names included.\n\n"
        "Reads nothing. Prints a table on a terminal, one line per key when piped.",
        "treadle config rollout\n  treadle config algorithm.kl.coef\n  treadle config | grep lr",
    ),
}
"""Each command's line in ``treadle --help``, and its own ``--help``: what it does, reads and
writes, and example command lines."""


def _about(command: str) -> dict:
    """The ``add_parser`` arguments of ``command``: its line in the top-level help, its
    description and its examples' epilog."""
    summary, description, examples = _ABOUT[command]
    return {
        "help": summary,
        "description": description,
        "epilog": f"examples:\n  {examples}",
        "formatter_class": _Help,
    }


class _Help(argparse.RawDescriptionHelpFormatter):
    """Paragraphs of the description reflowed to the terminal, the examples kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return super()._fill_text(text, width, indent)
        fill = argparse.HelpFormatter._fill_text
        return "\n\n".join(fill(self, p, width, indent) for p in text.split("\n\n"))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with ``key=value`` overrides also taken after an option
    (``treadle eval RUN --output DIR eval.k=[1,4]``): argparse gives a positional list only the
    words before the first option, and calls the rest unrecognized.

    Raises:
        SystemExit: (2) from argparse, for an argument that is not an override either.
    """
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [a for a in extra if "=" in a and not a.startswith("-")]
    if len(overrides) < len(extra) or (overrides and not hasattr(args, "overrides")):
        command = parser.commands.get(args.command, parser)  # its --help lists its options
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``treadle`` command; returns the process exit status.

    0 on success, 2 on a :class:`~treadle.core.errors.UserError` (printed to stderr), 143 on
    SIGTERM, 130 on SIGINT (Ctrl-C) and 129 on SIGHUP: a run stops after its step,
    checkpointed. When the reader of stdout goes away (``treadle config | head -1``) the output
    is dropped, quietly: a command printing through rich carries on to its own status (a
    training run is not cut short by a closed pager), one printing plain text (``--json``,
    ``--help``) ends with 0; a stderr without a reader loses its messages, not the status. 2,
    with one line on stderr, when stdout cannot be written (a full disk) or is closed (plan and
    simulate, whose output is their answer). ``argv`` defaults to ``sys.argv[1:]``.
    """
    try:
        status = _main(argv)
    except BrokenPipeError:  # a print() to stdout whose reader has gone
        if not _reader_gone(sys.stdout):
            raise
        status = 0
    except SystemExit:  # argparse's --help (0) and usage errors (2), their text in the buffers
        written = _flush(sys.stdout)
        _flush(sys.stderr)
        if not written:
            return 2
        raise
    except OSError as e:  # config, plan and simulate write nothing but stdout unguarded
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        status = _stdout_failed(e)
    written = _flush(sys.stdout)
    _flush(sys.stderr)
    return status if written or status else 2


def _reader_gone(stream: Any) -> bool:
    """Whether ``stream`` is a pipe or socket whose reader has closed it: poll reports an error
    (POLLERR, or POLLHUP) on the writing end of a pipe that has no reader left."""
    import select

    try:
        poll = select.poll()
        poll.register(stream.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or the stream closed or replaced
        return False


def _to_devnull(stream: Any) -> None:
    """Point ``stream``'s file descriptor at /dev/null: what is still buffered, and Python's
    own flush at exit, then go nowhere instead of failing."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def _flush(stream: Any) -> bool:
    """Write ``stream``'s buffered output now; where its reader has gone, drop it, quietly.
    False where it cannot be written (stdout on a full disk), said in one line on stderr.
    None (a descriptor closed before the start, ``>&-``) has nothing to write."""
    if stream is None:
        return True
    try:
        stream.flush()
    except BrokenPipeError:
        pass
    except OSError as e:
        if stream is sys.stderr:
            _to_devnull(stream)
        else:
            _stdout_failed(e)
        return False
    if _reader_gone(stream):
        _to_devnull(stream)
    return True


def _stdout_failed(error: OSError) -> int:
    """Say in one line that stdout cannot be written (a full disk), drop the rest of it, and
    return the exit status, 2."""
    _to_devnull(sys.stdout)
    _say(f"treadle: error: cannot write stdout ({error.strerror or error})")
    return 2


def _error_line(error: Exception) -> str:
    """A refusal as the one line it is meant to be (:func:`_cut`: a model folder whose name
    holds a line break, a value pasted whole into a flag)."""
    return f"treadle: error: {_cut(str(error))}"


def _say(message: str) -> None:
    """Print ``message`` to stderr; a stderr whose reader has gone loses it, not the exit
    status that follows it."""
    try:
        print(message, file=sys.stderr)
    except OSError:  # no reader, or a full disk
        _to_devnull(sys.stderr)


def _console(stderr: bool = False, **options: Any) -> Any:
    """A rich console on stdout (or ``stderr``) that drops its output, quietly, once the reader
    goes away, and lets the command carry on (rich's own default points stdout at /dev/null,
    whichever stream it writes, and exits with status 1 at that write). On stderr, whose
    lines are messages, a full disk loses them too, not the command's stdout or status."""
    from rich.console import Console

    class Quiet(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            _to_devnull(sys.stderr if stderr else sys.stdout)

    return Quiet(file=_Messages() if stderr else None, **options)


class _Messages:
    """stderr as a file for messages that may be lost: a write or flush that fails (no reader,
    a full disk, a descriptor closed) points stderr at /dev/null and carries on. It writes
    behind rich's proxy, which a status display on a terminal puts in ``sys.stderr`` and which
    prints through the console: writing into it looped for good (until 2026-12-07)."""

    @staticmethod
    def _stream() -> Any:
        stream = sys.stderr
        return getattr(stream, "rich_proxied_file", stream)

    @property
    def encoding(self) -> str:
        return getattr(self._stream(), "encoding", None) or "utf-8"

    def write(self, text: str) -> int:
        try:
            self._stream().write(text)
        except (AttributeError, OSError):
            _to_devnull(sys.stderr)
        return len(text)

    def flush(self) -> None:
        try:
            self._stream().flush()
        except (AttributeError, OSError):
            _to_devnull(sys.stderr)

    def isatty(self) -> bool:
        stream = self._stream()
        return bool(stream) and stream.isatty()

    def fileno(self) -> int:
        return self._stream().fileno()


def _main(argv: list[str] | None) -> int:
    """:func:`main`'s work: parse, then run the command."""
    try:
        args = _parse(argv)
    except KeyboardInterrupt:  # the parser imports the commands' modules
        return _interrupted_while_starting()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "config":  # pure data: answered without importing torch
        return _config(args.section)
    if args.command in ("plan", "simulate"):  # pure arithmetic: no torch either
        return _scale(args)
    try:  # torch and transformers take seconds to import: a Ctrl-C then has done nothing yet
        _import_torch()
        from treadle.core.errors import UserError
        from treadle.jobs.stopping import Stopped, stop_on_signal
    except KeyboardInterrupt:
        return _interrupted_while_starting()
    threading.excepthook = _quiet_disk_full(threading.excepthook)
    try:
        with stop_on_signal():  # SIGTERM stops any command at once; train waits for its step
            return _run(args)
    except UserError as e:
        _say(_error_line(e))
        return 2
    except Stopped as e:
        _say(f"treadle: {_stopped(e, args)}")
        return e.exit_code
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # Any write of the run (metrics, buffer, samples): all are atomic or appended whole.
        _say(
            f"treadle: error: disk full writing {e.filename or 'the run directory'} ({e.strerror});"
            " free space and continue with treadle train --resume RUN_DIR: the last checkpoint "
            "is intact"
        )
        return 2
    except KeyboardInterrupt:
        _say(
            "treadle: interrupted; nothing on disk is half-written: treadle train --resume "
            "RUN_DIR continues from the last checkpoint (an interrupted SFT warm-up starts again)"
        )
        return 130


def _interrupted_while_starting() -> int:
    """Say that a Ctrl-C came before any work, and return its exit status (130)."""
    _say("treadle: interrupted while starting; nothing was written")
    return 130


def _import_torch() -> None:
    """Import torch and transformers, quietened: treadle's own bars report a run."""
    import torch
    import transformers

    # Our own progress bars report the run; transformers' per-save/load bars only add noise.
    transformers.utils.logging.disable_progress_bar()
    if not torch.cuda.is_available():
        # accelerate imports DeepSpeed, where it is installed, whenever transformers saves a
        # model; left to detect its accelerator it prints a warning on the console
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _recipe_and_overrides(args: argparse.Namespace) -> tuple[str | Path, list[str]]:
    """The recipe a command runs (a resumed run's own ``config.yaml``) and its overrides.

    Raises:
        UserError: no recipe, or ``--resume`` not a run directory or given with a recipe.
    """
    from treadle.core.errors import UserError

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
    return recipe, overrides


def _run(args: argparse.Namespace) -> int:
    from treadle.config import load_config

    if args.command == "inspect":
        console = _console()
        # Piped to a file or a pager, rich would wrap the table at 80 columns.
        return _inspect(args, console if console.is_terminal else _console(width=160))
    console = _console()
    if args.command == "eval":
        return _eval(args, console)
    cfg = load_config(*_recipe_and_overrides(args))
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


def _scale(args: argparse.Namespace) -> int:
    """``treadle plan`` / ``treadle simulate``; 2 with one line on bad input, 130 on Ctrl-C, 143
    on SIGTERM, 129 on SIGHUP (a plot being written is removed, not left half-written)."""
    from treadle.core.errors import UserError
    from treadle.jobs.scale_job import run
    from treadle.jobs.stopping import Stopped, stop_on_signal

    if sys.stdout is None:  # closed at the start (>&-): the answer would be lost, silently
        _say(f"treadle: error: stdout is closed; treadle {args.command} prints its answer there: "
             "give it a file or a pipe (> answer.txt)")  # fmt: skip
        return 2
    # piped (not a terminal, no COLUMNS): wide enough that no table column is cut to "engi…"
    terminal = sys.stdout.isatty()
    wide = {} if terminal or "COLUMNS" in os.environ else {"width": 200}
    try:
        with stop_on_signal():  # SIGTERM, as Ctrl-C: the plot's temporary file removed
            return run(args, _console(stderr=True, **wide), _console(**wide))
    except UserError as e:
        _say(_error_line(e))
        return 2
    except (Stopped, KeyboardInterrupt) as e:
        if isinstance(e, Stopped) and e.signum != signal.SIGINT:
            _say(f"treadle: {_stopped(e, args)}")
            return e.exit_code
        _say("treadle: interrupted")
        return 130


def _config(name: str | None) -> int:
    """``treadle config [NAME]``: the keys as a table on a terminal, one aligned line per key
    when piped (for grep), a single key with its whole description; 2 on an unknown name."""
    from rich.table import Table
    from rich.text import Text

    from treadle.config.keys import select_keys
    from treadle.core.errors import UserError

    try:
        rows = select_keys(name)
    except UserError as e:
        _say(_error_line(e))
        return 2
    console = _console()
    if len(rows) == 1 and name is not None:
        (r,) = rows
        console.print(f"{r.key}  ({r.type}, default {r.default})", markup=False, highlight=False)
        console.print(r.text, markup=False, highlight=False)
        return 0
    if not console.is_terminal:
        # Capped widths: one long type (a Literal's choices) shifts its own line, not all.
        cols = [[r.key for r in rows], [r.type for r in rows], [r.default for r in rows]]
        widths = [min(max(map(len, col)), cap) for col, cap in zip(cols, (40, 28, 16), strict=True)]
        for r in rows:
            cells = (r.key.ljust(widths[0]), r.type.ljust(widths[1]), r.default.ljust(widths[2]))
            print("  ".join((*cells, r.meaning)))
        return 0
    table = Table("key", "type", "default", "meaning", box=None, highlight=False)
    for r in rows:
        table.add_row(*map(Text, (r.key, r.type, r.default, r.meaning)))  # no markup: [str]
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
