"""``treadle plan`` and ``treadle simulate``: :mod:`treadle.scale` on the command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import tempfile
from dataclasses import replace
from pathlib import Path

from treadle.core.errors import UserError, one_line
from treadle.jobs.scale_args import add_arguments
from treadle.jobs.scale_output import placement_row, print_plan, print_result, progress, result_row
from treadle.jobs.scale_runs import RunRoles, run_lengths, run_roles
from treadle.scale.checks import MAX_LORA_RANK, MAX_SPEC_TOKENS, MAX_TOKENS, check
from treadle.scale.hardware import Gpu, gpu
from treadle.scale.plan import (
    DEFAULT_ROLES,
    MAX_GPUS,
    ROLES,
    Question,
    check_fits,
    extra_forwards,
    fitting,
    rank,
)
from treadle.scale.shapes import ModelShape, resolve
from treadle.scale.simulate import (
    MAX_STEPS,
    Lengths,
    Setup,
    Workload,
    simulate,
)


def _check(args: argparse.Namespace) -> None:
    """Raises UserError for options out of range, naming the option and its range."""
    bounds = [("--gpus", args.gpus, 1, MAX_GPUS), ("--minibatches", args.minibatches, 1, 4096),
              ("--reward-seconds", args.reward_seconds, 0, 3600)]  # fmt: skip
    if args.lora_rank is not None:
        bounds += [("--lora-rank", args.lora_rank, 0, MAX_LORA_RANK)]
    if args.extra_forwards is not None:
        bounds += [("--extra-forwards", args.extra_forwards, 0, 8)]
    if args.length_sigma is not None:
        bounds += [("--length-sigma", args.length_sigma, 0, 3)]
    if args.steps is not None:
        bounds += [("--steps", args.steps, 2, MAX_STEPS)]
    if args.command == "plan":
        bounds += [("--micro-batch", args.micro_batch, 1, 4096)]
        bounds += [(args.spelled.get(n, f"--{n}"), getattr(args, n), 1,
                    MAX_GPUS if n == "ep" else 1024)
                   for n in ("tp", "pp", "sp", "ep") if getattr(args, n) is not None]  # fmt: skip
    else:
        bounds += [("--pack-tokens", args.pack_tokens, 0, MAX_TOKENS),
                   ("--oversample", args.oversample, 0, 4)]  # fmt: skip
    for name, value, low, high in bounds:
        if not low <= value <= high:
            raise UserError(f"{name} {value}: must be {low}..{high:,}")
    if args.lengths_from is not None and (
        args.max_response is not None
        or args.mean_response is not None
        or args.length_sigma is not None
    ):
        raise UserError(
            "--lengths-from takes the lengths from the run: drop --max-response, --mean-response "
            "and --length-sigma"
        )
    if args.command == "simulate":
        if 0 < args.spec_tokens <= MAX_SPEC_TOKENS and args.spec_accept is None:
            raise UserError(
                f"--spec-tokens {args.spec_tokens} needs --spec-accept A, the chance each draft "
                "token is accepted (DeepSeek-V3 reports 0.85-0.9 for its MTP token)"
            )
        if args.average_steps is not None:
            _check_average_steps(*args.average_steps, args.steps)
        if args.staleness is not None and args.mode != "async":
            raise UserError(f"--staleness applies to --mode async, not {args.mode}")
        if args.rollout_gpus is not None and not 1 <= args.rollout_gpus < args.gpus:
            raise UserError(
                f"--rollout-gpus {args.rollout_gpus}: the engines' share of --gpus {args.gpus}, "
                f"1..{args.gpus - 1} (the rest train); omit it for a colocated setup"
            )
    for option, path in (("--plot", args.plot), ("--lengths-from", args.lengths_from)):
        try:  # a name the file system refuses (over 255 bytes: ENAMETOOLONG) is bad input
            if path is not None:
                Path(path).exists()
        except OSError as e:
            shown = str(path) if len(str(path)) <= 80 else f"{str(path)[:80]}..."
            raise UserError(f"{option} {shown}: {e.strerror or e}") from None
    if args.plot is not None:
        _check_plot(Path(args.plot))


def _check_average_steps(first: int, last: int, steps: int | None) -> None:
    """Raises UserError for steps ``first``..``last`` that ``--steps`` does not simulate."""
    if last > MAX_STEPS:
        raise UserError(f"--average-steps {first}-{last}: steps 1..{MAX_STEPS} at most")
    if last > (steps or 0):
        raise UserError(f"--average-steps {first}-{last} averages simulated steps: give "
                        f"--steps {max(2, last)}..{MAX_STEPS}")  # fmt: skip


def _check_plot(path: Path) -> None:
    """Raises UserError for a ``--plot`` path that is no PNG file name, or whose folder is
    missing, or that could not be written (:func:`_check_writable`)."""
    if path.suffix.lower() != ".png" or not path.stem:
        raise UserError(f"--plot {path}: give a file name ending in .png")
    if not path.parent.is_dir():
        what = "is a file, not a folder" if path.parent.exists() else "does not exist"
        raise UserError(f"--plot {path}: the folder {path.parent} {what}")
    if path.is_dir():
        raise UserError(f"--plot {path}: a folder has that name; give a file name")
    _check_writable(path)


def _check_writable(path: Path) -> None:
    """Raises UserError where the plot ``path`` could not be written as :func:`_save` writes
    it (a file beside it, renamed onto it), checked before the work rather than after it: a
    probe file made, renamed and removed in its folder (a read-only folder, /proc, an
    append-only one), and an existing ``path`` of another user's in a sticky folder (/tmp),
    which no rename replaces."""
    folder, own = path.parent, os.geteuid()
    try:
        owner, held = path.stat().st_uid, folder.stat()
    except OSError:  # no such file yet (or none to read): the probe says the rest
        owner, held = own, None
    if held is not None and held.st_mode & stat.S_ISVTX and own not in (0, held.st_uid, owner):
        raise UserError(f"--plot {path}: it is another user's, in a sticky folder that only "
                        "lets its owner replace it; give another file name")  # fmt: skip
    probe = None
    try:  # made, renamed (as the plot is) and removed
        fd, made = tempfile.mkstemp(dir=folder, prefix=".treadle-plot-probe-")
        os.close(fd)
        probe = Path(made)
        probe = probe.replace(probe.with_name(probe.name + "-renamed"))
        probe.unlink()
        probe = None
    except OSError as e:
        what = "cannot write in" if probe is None else "cannot rename or remove files in"
        raise UserError(f"--plot {path}: {what} {folder} ({e.strerror or e})") from None
    finally:
        if probe is not None:  # a folder that let it be made and not removed: try once more
            with contextlib.suppress(OSError):
                probe.unlink()


def _roles(text: str | None, command: str) -> tuple[str, ...]:
    """``--roles`` as a tuple (None: the default roles). Raises UserError for an unknown, empty
    or repeated role, a plan without a policy, or a simulation without a policy or an
    engine."""
    if text is None:
        return DEFAULT_ROLES
    roles = tuple(r.strip().lower() for r in text.split(","))
    bad = [r for r in roles if r not in ROLES] + [r for r in ROLES if roles.count(r) > 1]
    if bad:
        first = bad[0]
        what = (f"{first!r} given twice" if first in ROLES else f"{first!r} is not a role"
                if first else "an empty role")  # fmt: skip
        raise UserError(
            f"--roles {text!r}: {what}; give each of {', '.join(ROLES)} at most once, "
            "comma-separated (e.g. policy,reference,engine)"
        )
    if "policy" not in roles or (command == "simulate" and "engine" not in roles):
        need, give = (("a policy on an engine's samples", "both") if command == "simulate"
                      else ("a policy", "one"))  # fmt: skip
        raise UserError(
            f"--roles {text!r}: an RL step trains {need}; give {give} (e.g. policy,engine)"
        )
    return roles


def _lora_given(args: argparse.Namespace) -> tuple[str, ...]:
    """The run config's LoRA keys the command line gives (``--lora-rank``, ``--lora-sync``):
    :func:`run_roles` neither reads nor checks the file's."""
    options = (("model.lora.r", args.lora_rank), ("model.lora.sync", args.lora_sync))
    return tuple(key for key, value in options if value is not None)


def _roles_and_forwards(args: argparse.Namespace) -> tuple[RunRoles, bool, str]:
    """``--roles`` (or, with ``--lengths-from`` and no ``--roles``, the run's own roles, its
    forwards, ReMax baseline and LoRA rank), whether those are the run's (then the forwards
    stand unless ``--extra-forwards`` is given; else they are what the roles run), and where
    the roles came from, for a line on stderr ("" for ``--roles`` or the default)."""
    if args.lengths_from is None:
        roles = _roles(args.roles, args.command)
        return RunRoles(roles, extra_forwards(roles)), False, ""
    if args.roles is not None:  # the run's LoRA and ReMax still hold, unless given
        roles = _roles(args.roles, args.command)
        run = None
        lora_sync_needed = args.lora_sync is None and args.lora_rank != 0  # the run's, then
        if args.lora_rank is None or args.greedy_baseline is None or lora_sync_needed:
            run = run_roles(args.lengths_from, fix="with --roles it is still read for the run's "
                            "LoRA rank and sync and ReMax baseline, unless --lora-rank 0 (or a "
                            "rank and --lora-sync) and --greedy-baseline or "
                            "--no-greedy-baseline are given", given=_lora_given(args))  # fmt: skip
        keep = (run.greedy_baseline, run.lora_rank, run.lora_sync) if run else (
            False, 0, "merged")  # fmt: skip
        kept = [what for what, given, value in (
            ("ReMax baseline", args.greedy_baseline, keep[0]),
            ("LoRA rank", args.lora_rank, keep[1]),
            ("LoRA adapter sync", args.lora_sync, keep[2] == "adapter"))
            if given is None and value]  # fmt: skip
        path = args.lengths_from / "config.yaml"
        source = f"--roles, with {path}'s {' and '.join(kept)}" if kept else ""
        return RunRoles(roles, extra_forwards(roles), *keep), False, source
    run = run_roles(args.lengths_from, given=_lora_given(args))
    if run is None:
        where = f"{args.lengths_from} has no config.yaml: the default roles"
        return RunRoles(DEFAULT_ROLES, extra_forwards(DEFAULT_ROLES)), False, where
    return run, True, f"roles from {args.lengths_from / 'config.yaml'}"


def _role_note(source: str, run: RunRoles, from_run: bool, work: Workload,
               args: argparse.Namespace) -> str:  # fmt: skip
    """The line saying where the roles came from and the forwards used (``--extra-forwards``
    named where it replaced the run's), with ReMax's baseline and LoRA where the step has
    them."""
    note = (f"{source}: {', '.join(run.roles)}; forwards besides the update's: "
            f"{work.extra_forwards}")  # fmt: skip
    if args.extra_forwards is not None and from_run:
        note += f" (--extra-forwards; the run's: {run.forwards})"
    if work.greedy_baseline:
        note += "; a greedy response a prompt (ReMax), not trained"
    if work.lora_rank:
        note += f"; LoRA rank {work.lora_rank}"
        note += ", its adapters synced alone" if work.lora_sync == "adapter" else ""
    return note


def _workload(args: argparse.Namespace, roles: tuple[str, ...],
              run: RunRoles | None = None) -> Workload:  # fmt: skip
    """The step's work from the options; ``--extra-forwards`` defaults to ``run``'s forwards
    (a run's config), else to what ``roles`` run (:func:`~treadle.scale.plan.extra_forwards`),
    a critic among them is trained, ReMax's greedy baseline is generated with
    ``--greedy-baseline`` or ``run``'s, and the LoRA rank is ``--lora-rank`` or ``run``'s."""
    prompt = 512 if args.prompt_tokens is None else args.prompt_tokens
    if args.lengths_from is not None:
        groups, prompts = run_lengths(args.lengths_from)
        responses = [n for g in groups for n in g]
        mean = sum(responses) / len(responses)
        lengths = Lengths(mean, max(responses), measured=tuple(groups))
        if args.prompt_tokens is None:
            prompt = round(sum(prompts) / len(prompts))
    else:
        longest = 4096 if args.max_response is None else args.max_response
        mean = longest / 3 if args.mean_response is None else args.mean_response
        sigma = 0.8 if args.length_sigma is None else args.length_sigma
        lengths = Lengths(mean, longest, sigma)
    run = run or RunRoles(roles, extra_forwards(roles))
    forwards = run.forwards if args.extra_forwards is None else args.extra_forwards
    reward_shape = _reward_shape(args, roles)
    rank = _given(args.lora_rank, run.lora_rank)
    sync = _given(args.lora_sync, run.lora_sync if rank else "merged")  # LoRA off: no adapters
    return Workload(args.prompts, args.samples, prompt, lengths, args.reward_seconds, forwards,
                    args.minibatches, critic="critic" in roles, pack_tokens=args.pack_tokens,
                    recompute=args.recompute,
                    greedy_baseline=_given(args.greedy_baseline, run.greedy_baseline),
                    lora_rank=rank, lora_sync=sync, reward_shape=reward_shape)  # fmt: skip


def _reward_shape(args: argparse.Namespace, roles: tuple[str, ...]) -> ModelShape | None:
    """The reward role's shape: ``--reward-model``'s, else the policy's (a sequence classifier
    of its size: its forward without the vocabulary head); None without a reward role.
    Raises UserError for ``--reward-model`` without the reward role, or one not resolved."""
    if "reward" not in roles:
        if args.reward_model is None:
            return None
        suggested = [*(r for r in roles if r != "engine"), "reward",
                     *(["engine"] if "engine" in roles else [])]  # fmt: skip
        raise UserError(
            f"--reward-model {args.reward_model} sizes the reward role, which the roles "
            f"({','.join(roles)}) leave out: add it, e.g. --roles {','.join(suggested)}"
        )
    try:
        return resolve(args.model if args.reward_model is None else args.reward_model)
    except UserError as e:
        given = args.reward_model is not None
        raise UserError(f"--reward-model: {e}" if given else str(e)) from None


def _given(option: object, default: object) -> object:
    """``option`` as given on the command line, else ``default`` (the run's, or the usual)."""
    return default if option is None else option


def _save(draw, path: Path, console) -> None:
    """Write the plot ``draw(tmp)`` makes to ``path`` through a temporary file beside it,
    renamed into place, so a failed write never leaves a half-written ``path``; says where
    on ``console`` (stderr: stdout may carry --json)."""
    tmp = path.with_name(f".treadle-plot-{os.getpid()}.tmp.png")  # short: any legal name fits
    try:
        with console.status("drawing the plot"):  # a minute at the largest settings
            draw(tmp)
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"--plot {path}: cannot write it ({e.strerror or e})") from None
    except BaseException:  # Ctrl-C mid-write: no half-written file left beside the plot
        tmp.unlink(missing_ok=True)
        raise
    console.print(f"plot: {one_line(str(path))}", markup=False, soft_wrap=True)  # to copy


def _check_lora_rank(args: argparse.Namespace, shape: ModelShape, rank: int) -> None:
    """Raises UserError for a LoRA rank (``--lora-rank``, or the run's) above ``shape``'s
    width: an adapter pair on a hidden x hidden matrix holds r x 2 x hidden parameters, the
    matrix's own count at r = hidden / 2, and no rank above the width adds expressiveness."""
    if rank > shape.hidden:
        given = (f"--lora-rank {rank}" if args.lora_rank is not None else
                 f"--lengths-from {args.lengths_from}: model.lora.r {rank}")  # fmt: skip
        raise UserError(f"{given}: more than {shape.name}'s hidden size, {shape.hidden}; its "
                        "adapters would outgrow the weights they adapt: use --lora-rank up to "
                        f"{shape.hidden} (8-256 is usual), or 0 to train every weight")  # fmt: skip


def run(args: argparse.Namespace, console, out=None) -> int:
    """Answer ``treadle plan`` or ``treadle simulate``: tables on ``out`` (stdout by default) or
    JSON on stdout, messages on ``console`` (stderr). Raises UserError on bad input."""
    from rich.console import Console

    out = out or Console()
    _check(args)
    run, from_run, source = _roles_and_forwards(args)
    roles = run.roles
    shape, g = resolve(args.model), gpu(args.gpu.lower())
    work = _workload(args, roles, run)
    _check_lora_rank(args, shape, work.lora_rank)
    # where the roles came from, once the input is known good (no note above a refusal)
    note = _role_note(source, run, from_run, work, args) if source else ""
    if args.command == "plan":
        q = Question(shape, g, args.gpus, work, args.micro_batch, roles, tp=args.tp,
                     pp=args.pp, sp=args.sp, ep=args.ep, offload=args.offload)  # fmt: skip
        fits = fitting(q, names=args.spelled)
        _say(console, note)
        with console.status("simulating the placements that fit") as status:
            placements = rank(q, fits, steps=args.steps, progress=progress(status, args.steps))
        if args.plot:
            from treadle.scale.plots import memory

            title = f"{shape.name} on {args.gpus} x {g.name}"
            _save(lambda p: memory(placements, g.memory_gib, p, title), Path(args.plot), console)
        if args.json:
            print(json.dumps([placement_row(p) for p in placements], indent=1))
        else:
            print_plan(out, placements, g.memory_gib)
            if work.lora_rank and "reference" in roles:
                out.print(f"LoRA rank {work.lora_rank}: the reference is the policy with its "
                          "adapters disabled, no memory of its own", markup=False)  # fmt: skip
        return 0
    setup = _setup(args, g)
    check(shape, work, setup)  # the setup's own errors (an engine's KV cache) first
    placed = check_fits(Question(shape, g, args.gpus, work, 1, roles, offload=setup.offload),
                        setup)  # fmt: skip
    if setup.offload:  # every role's states move, a critic's and a reward model's too
        setup = replace(setup, offload_bytes=placed.resident)
    _say(console, note)
    with console.status("simulating") as status:
        r = simulate(shape, work, setup, steps=args.steps, progress=progress(status, args.steps),
                     window=args.average_steps)  # fmt: skip
    if args.plot:
        from treadle.scale.plots import timeline

        where = ("colocated" if setup.colocated
                 else f"{setup.rollout_gpus}:{setup.train_gpus} engine:training GPUs")  # fmt: skip
        mode = f"async eta {setup.eta:g}" if setup.mode == "async" else setup.mode
        title = (f"{shape.name} on {args.gpus} x {g.name}, {where}, {mode}: step "
                 f"{r.step_s:.1f} s, staleness mean {r.staleness_mean:.2f}")  # fmt: skip
        _save(lambda p: timeline(r, p, title), Path(args.plot), console)
    row = result_row(r)
    if args.json:
        print(json.dumps([row], indent=1))
    else:
        print_result(out, r)
    return 0


def _say(console, note: str) -> None:
    """``note`` on ``console`` (stderr) as one line, where there is one."""
    if note:
        console.print(note, markup=False, soft_wrap=True)


def _setup(args: argparse.Namespace, g: Gpu) -> Setup:
    """``treadle simulate``'s placement and mode: colocated on ``--gpus``, or the engines on
    ``--rollout-gpus`` and the trainer on the rest."""
    rollout = args.rollout_gpus or args.gpus
    colocated = args.rollout_gpus is None
    staleness = (1.0 if args.mode == "async" else 0.0) if args.staleness is None else args.staleness
    return Setup(g, rollout, args.gpus - rollout if not colocated else args.gpus, colocated,
                 engine_tp=args.engine_tp, train_tp=args.train_tp, train_pp=args.train_pp,
                 train_sp=args.train_sp, train_ep=args.train_ep, mode=args.mode,
                 staleness=staleness,
                 partial=args.partial, oversample=args.oversample,
                 sync_method=args.sync_method, updates_per_sync=args.updates_per_sync,
                 drop_stale=args.drop_stale, offload=args.offload,
                 spec_tokens=args.spec_tokens, spec_accept=args.spec_accept or 0.0,
                 sync_seconds=args.sync_seconds)  # fmt: skip


def simulate_argv(shape: str, work: Workload, setup: Setup, roles: tuple[str, ...] = DEFAULT_ROLES,
                  steps: int | None = None,
                  window: tuple[int, int] | None = None) -> list[str]:  # fmt: skip
    """The ``treadle simulate`` arguments that give ``setup`` and ``work`` (lognormal lengths,
    the GPU type's own efficiencies), whose memory check holds ``roles``, and that simulate
    ``steps`` and average the ``window`` of them (None: to the steady state): SCALE.md's rows
    on the command line. Raises ValueError where ``work`` trains a critic that ``roles`` does
    not hold, or the other way round."""
    w, s = work, setup
    if w.critic != ("critic" in roles):
        raise ValueError(f"Workload.critic {w.critic} with roles {roles}: the CLI trains a critic "
                         "exactly where --roles holds one")  # fmt: skip
    argv = [shape, "--gpu", s.gpu.name, "--prompts", str(w.prompts), "--samples",
            str(w.samples_per_prompt), "--prompt-tokens", str(w.prompt_tokens),
            "--max-response", str(w.lengths.max), "--mean-response", _number(w.lengths.mean),
            "--length-sigma", _number(w.lengths.sigma)]  # fmt: skip
    if s.colocated:
        argv += ["--gpus", str(s.train_gpus)]
    else:
        argv += [
            "--gpus",
            str(s.rollout_gpus + s.train_gpus),
            "--rollout-gpus",
            str(s.rollout_gpus),
        ]
    options = {"--minibatches": w.minibatches,
               "--reward-seconds": w.reward_s, "--pack-tokens": w.pack_tokens,
               "--engine-tp": s.engine_tp, "--train-tp": s.train_tp, "--train-pp": s.train_pp,
               "--train-sp": s.train_sp, "--train-ep": s.train_ep, "--oversample": s.oversample,
               "--updates-per-sync": s.updates_per_sync,
               "--spec-tokens": s.spec_tokens, "--recompute": w.recompute}  # fmt: skip
    parser = argparse.ArgumentParser()
    add_arguments(parser, "simulate")  # the options' defaults, left out
    default = lambda option: parser.get_default(option[2:].replace("-", "_"))  # noqa: E731
    argv += [a for k, v in options.items() if v != default(k) for a in (k, _number(v))]
    if w.lora_rank:
        argv += ["--lora-rank", str(w.lora_rank)]
    if w.lora_sync != "merged":
        argv += ["--lora-sync", w.lora_sync]
    if w.reward_shape is not None:  # a named shape's name (a config.json's is its folder's)
        argv += ["--reward-model", w.reward_shape.name]
    if w.extra_forwards != extra_forwards(roles):  # --extra-forwards' default
        argv += ["--extra-forwards", str(w.extra_forwards)]
    if s.spec_tokens:
        argv += ["--spec-accept", _number(s.spec_accept)]
    if s.mode != "sync":
        argv += ["--mode", s.mode]
    if s.mode == "async":
        argv += ["--staleness", _number(s.staleness)]
    flags = {"--partial": s.partial, "--drop-stale": s.drop_stale, "--offload": s.offload,
             "--greedy-baseline": w.greedy_baseline}  # fmt: skip
    argv += [k for k, on in flags.items() if on]
    if s.sync_seconds is not None:
        argv += ["--sync-seconds", _number(s.sync_seconds)]
    if roles != DEFAULT_ROLES:
        argv += ["--roles", ",".join(roles)]
    argv += ["--sync-method", s.sync_method] if s.sync_method else []
    return argv + _steps_argv(steps, window)


def _steps_argv(steps: int | None, window: tuple[int, int] | None) -> list[str]:
    """``--steps`` and ``--average-steps`` for ``steps`` and ``window``, where given."""
    argv = ["--steps", str(steps)] if steps is not None else []
    return argv + (["--average-steps", f"{window[0]}-{window[1]}"] if window else [])


def _number(value: float | str) -> str:
    """``value`` as an option's text that parses back to it exactly: ``47.2``, ``1500``,
    ``3600.0001`` where ``:g`` would round it to ``3600``, and an integer's digits (``:g``
    writes 1,000,000 as ``1e+06``, which an integer option refuses); a choice's text as it
    is."""
    if isinstance(value, int | str):
        return str(value)
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))
