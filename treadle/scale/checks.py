"""The settings :func:`treadle.scale.simulate.simulate` refuses, each with the option to change
(:class:`~treadle.core.errors.UserError`), and the simulator's size limits."""

from __future__ import annotations

from dataclasses import replace

from treadle.core.errors import UserError
from treadle.scale.costs import SYNC_METHODS, Lengths, Setup, Workload, kv_capacity
from treadle.scale.hardware import Gpu
from treadle.scale.shapes import ModelShape
from treadle.scale.values import choice, flag, instance, kind, number

MAX_STALENESS = 64
"""Largest eta :func:`check` takes: the simulation's queue holds ``eta + steps`` batches of
requests, so its time and memory grow with it."""
MAX_SPEC_TOKENS = 16
"""Most draft tokens a decode step proposes (speculative decoding)."""
MAX_UPDATES_PER_SYNC = 256
"""Most updates a weight sync :func:`check` takes (verl's trigger_parameter_sync_step is 4 in
its recipes): each update is at least one optimizer step and an event of its own."""
MAX_LORA_RANK = 4096
"""Largest LoRA rank :func:`check` takes (a rank near the model's width is no longer low)."""
MAX_BATCH = 65536
"""Most samples per step :func:`check` takes, for the same reason as :data:`MAX_STALENESS`."""
MAX_TOKENS = 2**24
"""Most tokens of a packed micro-batch (16.8M)."""
MAX_SEQ = 2**40
"""Most tokens of a prompt or a response (1.1e12): far past any model's context, so an engine's
KV cache refuses such a length by name first; a bound keeps the arithmetic in a float's range."""


def check(shape: ModelShape, work: Workload, setup: Setup) -> None:
    """Raises UserError, naming the option to change, for a setup that cannot run (the work's
    own errors first, :func:`check_work`), and naming the field for one of the wrong kind or
    out of its option's range (a ``Setup`` built in Python: :mod:`.values`)."""
    check_work(work)
    _check_setup_kinds(setup)
    if work.greedy_baseline and (setup.mode != "sync" or setup.oversample):
        raise UserError(
            "ReMax's greedy baseline (--greedy-baseline, or a run's algorithm.advantage=remax): "
            "the greedy responses are generated after the batch's samples, with its policy: use "
            "--mode sync without --oversample (treadle's remax takes rollout.mode=sync), or "
            "--no-greedy-baseline"
        )
    if setup.engine_tp < 1:
        raise UserError(f"--engine-tp {setup.engine_tp} must be at least 1")
    if setup.rollout_gpus < 1 or setup.train_gpus < 1:
        raise UserError(
            f"{setup.rollout_gpus} engine GPUs and {setup.train_gpus} training GPUs: both must be "
            "at least 1 (disaggregated: --rollout-gpus below --gpus)"
        )
    if setup.rollout_gpus % setup.engine_tp:
        gpus = "--gpus" if setup.colocated else "--rollout-gpus"
        raise UserError(f"--engine-tp {setup.engine_tp} does not divide {gpus} "
                        f"{setup.rollout_gpus}{_engine_tp_hint(shape, setup)}")  # fmt: skip
    _check_methods(work, setup)
    if setup.colocated and (setup.mode != "sync" or setup.rollout_gpus != setup.train_gpus):
        raise UserError(
            "a colocated setup takes turns on the same GPUs: use --mode sync, or give the "
            "engines GPUs of their own with --rollout-gpus N for one_step or async"
        )
    if shape.heads % setup.engine_tp:
        raise UserError(
            f"--engine-tp {setup.engine_tp} does not divide {shape.name}'s {shape.heads} heads"
            f"{_engine_tp_hint(shape, setup)}"
        )
    if not engine_tp_splits_kv(shape, setup.engine_tp):
        raise UserError(
            f"--engine-tp {setup.engine_tp} must divide {shape.name}'s {shape.kv_heads} KV heads "
            "or be a multiple of them (vLLM splits the KV heads over the GPUs, or gives each GPU "
            f"whole copies){_engine_tp_hint(shape, setup)}"
        )
    if not (0 <= setup.staleness <= MAX_STALENESS):  # also refuses NaN
        raise UserError(f"--staleness {setup.staleness:g} must be in 0..{MAX_STALENESS}")
    _check_training(shape, work, setup)
    for option, on in (("--partial", setup.partial), ("--drop-stale", setup.drop_stale)):
        if on and setup.mode != "async":
            raise UserError(f"{option} applies to --mode async (one_step and sync drain instead)")
    if setup.mode == "async" and setup.staleness <= 0 and setup.partial:
        raise UserError("--partial needs --staleness above 0 (eta = 0 is synchronous)")
    _check_setup_ranges(setup)
    _check_kv_cache(shape, work, setup)


def _engine_tp_hint(shape: ModelShape, setup: Setup) -> str:
    """``; use --engine-tp ...``: the largest engine TPs (up to 4 of them) that divide the
    engines' GPUs and the heads and split the KV heads as vLLM does; "" where none does."""
    n = setup.rollout_gpus
    fits = [t for t in range(1, min(n, shape.heads) + 1)
            if n % t == 0 and shape.heads % t == 0
            and engine_tp_splits_kv(shape, t)][-4:]  # fmt: skip
    return f"; use --engine-tp {' or '.join(map(str, fits))}" if fits else ""


def _splits(gpus: int, model_parallel: int, ep: int) -> bool:
    """Whether ``model_parallel`` GPUs a data-parallel rank divide ``gpus``, leaving ranks that
    ``ep`` expert-parallel ranks divide (``ep`` 0: any)."""
    return gpus % model_parallel == 0 and (ep <= 0 or gpus // model_parallel % ep == 0)


def _check_expert_parallel(shape: ModelShape, setup: Setup) -> None:
    """``--train-ep``: 0 (the default), or a degree that divides both the trainer's
    data-parallel ranks and a MoE model's experts, as Megatron requires (1 on a dense model,
    Megatron's default, is no expert parallelism)."""
    ep = setup.train_ep
    if ep == 0 or (ep == 1 and not shape.experts):
        return
    if not shape.experts:
        raise UserError(f"--train-ep {ep}: {shape.name} has no experts; leave --train-ep out")
    dp = setup.train_gpus // (setup.train_tp * setup.train_pp * setup.train_sp)
    if ep < 0 or dp % ep or shape.experts % ep:
        fits = [n for n in range(1, dp + 1) if dp % n == 0 and shape.experts % n == 0][-4:]
        raise UserError(
            f"--train-ep {ep} must divide the trainer's {dp} data-parallel ranks and "
            f"{shape.name}'s {shape.experts} experts: use --train-ep "
            f"{' or '.join(map(str, fits))}"
        )


def _check_training(shape: ModelShape, work: Workload, setup: Setup) -> None:
    """The trainer's part of :func:`check`: its layout and streamed updates."""
    tp, pp, sp = setup.train_tp, setup.train_pp, setup.train_sp
    ep = setup.train_ep if shape.experts else 0  # the hints keep a given expert-parallel degree
    if min(tp, pp, sp) < 1 or setup.train_gpus % (tp * pp * sp):
        n = setup.train_gpus
        tps = [t for t in range(1, n + 1) if _splits(n, t * pp * sp, ep)
               and shape.heads % (t * sp) == 0] if min(pp, sp) >= 1 else []  # fmt: skip
        pps = [p for p in range(1, min(n, shape.layers) + 1) if _splits(n, tp * p * sp, ep)
               ] if min(tp, sp) >= 1 and not tps else []  # fmt: skip
        sps = [s for s in range(1, shape.heads // tp + 1)
               if _splits(n, tp * pp * s, ep) and shape.heads % (tp * s) == 0
               ] if min(tp, pp) >= 1 and not tps and not pps else []  # fmt: skip
        hint = (f"; with --train-pp {pp} --train-sp {sp}: --train-tp "
                f"{' or '.join(map(str, tps[-4:]))}" if tps else
                f"; with --train-tp {tp} --train-sp {sp}: --train-pp "
                f"{' or '.join(map(str, pps[-4:]))}" if pps else
                f"; with --train-tp {tp} --train-pp {pp}: --train-sp "
                f"{' or '.join(map(str, sps[-4:]))}" if sps else "")  # fmt: skip
        raise UserError(
            f"--train-tp {tp} x --train-pp {pp} x --train-sp {sp} must be at least 1 each and "
            f"divide the {setup.train_gpus} training GPUs{hint}"
        )
    if shape.heads % (tp * sp):
        if shape.heads % tp:  # the tensor-parallel degrees the heads and GPUs take, at this sp
            fits = [t for t in range(1, setup.train_gpus + 1) if shape.heads % (t * sp) == 0
                    and _splits(setup.train_gpus, t * pp * sp, ep)]  # fmt: skip
            option, given = "--train-tp", f"--train-sp {sp}"
        else:
            fits = [s for s in range(1, shape.heads // tp + 1) if shape.heads % (tp * s) == 0
                    and _splits(setup.train_gpus, tp * pp * s, ep)]  # fmt: skip
            option, given = "--train-sp", f"--train-tp {tp}"
        hint = f"; with {given}: {option} {' or '.join(map(str, fits[-4:]))}" if fits else ""
        raise UserError(
            f"--train-tp {tp} x --train-sp {sp} must divide {shape.name}'s {shape.heads} "
            f"attention heads (each GPU attends over whole heads){hint}"
        )
    if setup.train_pp > shape.layers:
        raise UserError(f"--train-pp {setup.train_pp}: more stages than {shape.layers} layers")
    _check_expert_parallel(shape, setup)
    k = setup.updates_per_sync
    if not (1 <= k <= MAX_UPDATES_PER_SYNC) or work.prompts % k:
        raise UserError(
            f"--updates-per-sync {k} must be in 1..{MAX_UPDATES_PER_SYNC} and divide --prompts "
            f"{work.prompts}"
        )
    if work.minibatches > 1 and work.minibatches % k:
        raise UserError(
            f"--minibatches {work.minibatches} optimizer steps a step do not split evenly over "
            f"--updates-per-sync {k} updates a sync: use a multiple of {k}"
        )
    if setup.colocated and setup.updates_per_sync > 1:
        raise UserError(
            "--updates-per-sync streams a step's groups to a trainer of its own: give the "
            "engines GPUs of their own with --rollout-gpus N"
        )


def check_work(work: Workload) -> None:
    """Raises UserError, naming the option to change, for a step's work that cannot run,
    wherever it is placed (``treadle plan`` checks it with no engine role too)."""
    _check_work_kinds(work)
    if work.prompts < 1 or work.samples_per_prompt < 1 or work.batch > MAX_BATCH:
        raise UserError(
            f"--prompts {work.prompts} x --samples {work.samples_per_prompt}: both must be at "
            f"least 1 and their product at most {MAX_BATCH:,}"
        )
    if work.minibatches > work.batch:
        raise UserError(
            f"--minibatches {work.minibatches}: more optimizer steps than the step's {work.batch} "
            f"samples (--prompts x --samples); at most {work.batch}"
        )
    for option, tokens in (("--prompt-tokens", work.prompt_tokens),
                           ("--max-response", work.lengths.max)):  # fmt: skip
        if tokens < 1:
            raise UserError(f"{option} {tokens}: must be at least 1 token")
    if not (0 < work.lengths.mean <= work.lengths.max):
        raise UserError(
            f"--mean-response {work.lengths.mean:g} must be above 0 and at most --max-response "
            f"{work.lengths.max}"
        )
    if not 0 <= work.lora_rank <= MAX_LORA_RANK:
        raise UserError(f"LoRA rank {work.lora_rank} (--lora-rank, or the run's model.lora.r): "
                        f"must be 0..{MAX_LORA_RANK:,}")  # fmt: skip
    if work.reward_shape is not None and work.extra_forwards < 1:
        raise UserError(f"--extra-forwards {work.extra_forwards} leaves no forward for the reward "
                        "model: give at least 1")  # fmt: skip
    if work.lora_sync == "adapter" and not work.lora_rank:
        raise UserError("--lora-sync adapter sends LoRA adapters: give their rank, --lora-rank R "
                        "(treadle's model.lora.r), or drop --lora-sync")  # fmt: skip
    _check_work_ranges(work)


def engine_tp_splits_kv(shape: ModelShape, tp: int) -> bool:
    """Whether vLLM can spread ``shape``'s KV heads over ``tp`` GPUs: ``tp`` divides them or is
    a multiple of them (MLA's latent is not split)."""
    kv = shape.kv_heads
    return shape.mla or (kv % tp == 0 if tp < kv else tp % kv == 0)


def _check_methods(work: Workload, setup: Setup) -> None:
    """The decoding, weight-sync and packing options' part of :func:`check`."""
    if not 0 <= setup.spec_tokens <= MAX_SPEC_TOKENS:
        raise UserError(f"--spec-tokens {setup.spec_tokens} must be in 0..{MAX_SPEC_TOKENS}")
    if not 0 <= setup.spec_accept <= 1:  # also refuses NaN
        raise UserError(f"--spec-accept {setup.spec_accept:g} must be in 0..1")
    if setup.spec_accept and not setup.spec_tokens:
        raise UserError(
            "--spec-accept is the chance a draft token is accepted: add --spec-tokens K"
        )
    if setup.sync_seconds is not None and not 0 < setup.sync_seconds <= 3600:  # and NaN
        raise UserError(
            f"--sync-seconds {setup.sync_seconds:g}: a measured weight update, in 0..3,600 s "
            "(above 0)"
        )
    if setup.sync_method not in (None, *SYNC_METHODS):
        raise UserError(f"--sync-method {setup.sync_method}: one of {', '.join(SYNC_METHODS)}")
    if setup.sync_method in ("colocated", "gathered") and not setup.colocated:
        raise UserError(
            f"--sync-method {setup.sync_method} updates engines on the trainer's own GPUs: omit "
            "--rollout-gpus, or use broadcast or resharded for engines on GPUs of their own"
        )
    if setup.offload and not setup.colocated:
        raise UserError(
            "--offload moves a colocated trainer's states out of the engines' way: omit "
            "--rollout-gpus (engines on GPUs of their own need no room from the trainer)"
        )
    if work.pack_tokens < 0:
        raise UserError(
            f"--pack-tokens {work.pack_tokens} must be at least 0 (0: one sequence a micro-batch)"
        )
    if work.pack_tokens and work.pack_tokens < work.prompt_tokens + work.lengths.max:
        raise UserError(
            f"--pack-tokens {work.pack_tokens} is less than one prompt + longest response "
            f"({work.prompt_tokens + work.lengths.max:,} tokens): a micro-batch holds whole "
            "sequences"
        )


def _check_kv_cache(shape: ModelShape, work: Workload, setup: Setup) -> None:
    """One engine's KV cache must hold one prompt and the longest response."""
    capacity = kv_capacity(shape, setup)
    longest = work.prompt_tokens + work.lengths.max
    verified = setup.spec_tokens + 1 if setup.spec_tokens else 0  # a step's tokens beyond it
    if capacity < longest + verified:
        weights = 2.0 * shape.params() / setup.engine_tp / 2**30
        # the narrowest wider engine that holds it (vLLM's TP: the heads split evenly)
        need = longest + verified
        wider = [t for t in range(setup.engine_tp + 1, shape.heads + 1)
                 if shape.heads % t == 0 and engine_tp_splits_kv(shape, t)
                 and kv_capacity(shape, replace(setup, engine_tp=t)) >= need]  # fmt: skip
        if not wider:
            more = ("no engine of this GPU holds it, whatever its --engine-tp: lower "
                    "--max-response or --prompt-tokens, or use a GPU with more memory")  # fmt: skip
        elif setup.rollout_gpus % wider[0] == 0:
            more = f"use --engine-tp {wider[0]} or a GPU with more memory"
        else:
            more = (f"use --engine-tp {wider[0]} on a multiple of {wider[0]} engine GPUs "
                    "(--rollout-gpus, --gpus) or a GPU with more memory")  # fmt: skip
        raise UserError(
            f"one engine's KV cache holds {max(0, int(capacity)):,} tokens after "
            f"{weights:.1f} GiB of weights per GPU, fewer than one prompt + longest response "
            f"({longest:,}{f' + {verified} verified' if verified else ''}): {more}"
        )


_WORK_COUNTS = (
    ("prompts", "--prompts", 1, MAX_BATCH), ("samples_per_prompt", "--samples", 1, MAX_BATCH),
    ("prompt_tokens", "--prompt-tokens", 1, MAX_SEQ),
    ("extra_forwards", "--extra-forwards", 0, 8), ("minibatches", "--minibatches", 1, 4096),
    ("pack_tokens", "--pack-tokens", 0, MAX_TOKENS), ("lora_rank", "--lora-rank", 0, MAX_LORA_RANK),
)  # fmt: skip
"""A ``Workload``'s counts: field, option, least and most."""
_SETUP_COUNTS = (
    ("rollout_gpus", "--rollout-gpus", 1), ("train_gpus", "--gpus", 1),
    ("engine_tp", "--engine-tp", 1), ("train_tp", "--train-tp", 1), ("train_pp", "--train-pp", 1),
    ("train_sp", "--train-sp", 1), ("train_ep", "--train-ep", 0),
    ("updates_per_sync", "--updates-per-sync", 1), ("spec_tokens", "--spec-tokens", 0),
)  # fmt: skip
"""A ``Setup``'s counts: field, option and least (the most: 2**20)."""


def _check_work_kinds(work: Workload) -> None:
    """``work``'s fields of the right kind (a ``Workload`` built in Python: the CLI's parsers
    give no other): counts are integers, the rest numbers, names and flags their choices."""
    for field, option, _, _ in _WORK_COUNTS:
        kind(f"Workload.{field} ({option})", getattr(work, field), integer=True)
    kind("Workload.reward_s (--reward-seconds)", work.reward_s)
    choice("Workload.recompute (--recompute)", work.recompute, ("none", "selective", "full"))
    choice("Workload.lora_sync (--lora-sync)", work.lora_sync, ("merged", "adapter"))
    for field in ("critic", "greedy_baseline"):
        flag(f"Workload.{field}", getattr(work, field))
    instance("Workload.lengths", work.lengths, Lengths)
    instance("Workload.reward_shape (--reward-model)", work.reward_shape, ModelShape, none=True)
    kind("Lengths.max (--max-response)", work.lengths.max, integer=True)
    kind("Lengths.mean (--mean-response)", work.lengths.mean)
    kind("Lengths.sigma (--length-sigma)", work.lengths.sigma)
    for k, group in enumerate(work.lengths.measured):  # a run's buffer: whole tokens, >= 0
        for n in group:
            number(f"Lengths.measured[{k}]", n, 0, MAX_SEQ, integer=True)


def _check_work_ranges(work: Workload) -> None:
    """``work``'s fields in the ranges their options take, after :func:`check_work`'s own
    checks (which name the options as the CLI gives them): those the CLI bounds before."""
    for field, option, low, high in _WORK_COUNTS:
        number(f"Workload.{field} ({option})", getattr(work, field), low, high, integer=True)
    number("Workload.reward_s (--reward-seconds)", work.reward_s, 0, 3600)
    number("Lengths.max (--max-response)", work.lengths.max, 1, MAX_SEQ, integer=True)
    number("Lengths.sigma (--length-sigma)", work.lengths.sigma, 0, 3)


def _check_setup_kinds(setup: Setup) -> None:
    """``setup``'s fields of the right kind (as :func:`_check_work_kinds`)."""
    instance("Setup.gpu (--gpu)", setup.gpu, Gpu)
    for field, option, _ in _SETUP_COUNTS:
        kind(f"Setup.{field} ({option})", getattr(setup, field), integer=True)
    choice("Setup.mode (--mode)", setup.mode, ("sync", "one_step", "async"))
    for field, option in (("staleness", "--staleness"), ("oversample", "--oversample"),
                          ("spec_accept", "--spec-accept"), ("sync_seconds", "--sync-seconds"),
                          ("offload_bytes", "sized by --offload")):  # fmt: skip
        if getattr(setup, field) is not None:
            kind(f"Setup.{field} ({option})", getattr(setup, field))
    for field in ("colocated", "partial", "drop_stale", "offload"):
        flag(f"Setup.{field}", getattr(setup, field))


def _check_setup_ranges(setup: Setup) -> None:
    """``setup``'s fields in the ranges their options take, after :func:`check`'s own."""
    for field, option, low in _SETUP_COUNTS:
        number(f"Setup.{field} ({option})", getattr(setup, field), low, 2**20, integer=True)
    number("Setup.oversample (--oversample)", setup.oversample, 0, 4)
    if setup.offload_bytes is not None:
        number("Setup.offload_bytes (sized by --offload)", setup.offload_bytes, 0, 1e18)
