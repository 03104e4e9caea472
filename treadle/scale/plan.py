"""Placements of an RL recipe's roles on N GPUs, the memory each needs per GPU, which fit,
and their simulated step time.

A *colocated* placement runs the engine and the trainer on the same GPUs in turns (verl's
hybrid engine): during rollout the trainer's parameters, gradients and optimizer states stay
resident beside the engine's weights and KV cache (or, offloaded, wait in host memory: verl's
param and optimizer offload, NeMo-RL's colocated mode), and during the update the engine sleeps
(its KV cache freed, its weights offloaded, vLLM's sleep mode). A *disaggregated* placement
gives the engines their own GPUs (AReaL, verl's fully-async recipe).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import get_args

from treadle.core.errors import UserError
from treadle.scale.checks import MAX_TOKENS, check, check_work, engine_tp_splits_kv
from treadle.scale.hardware import GIB, Gpu
from treadle.scale.memory import (
    Breakdown,
    Layout,
    Recompute,
    check_layout,
    engine,
    kv_bytes_per_token,
    trainer,
    trainer_layout,
    update_phase,
)
from treadle.scale.shapes import ModelShape
from treadle.scale.simulate import Lengths, Result, Setup, Workload, simulate
from treadle.scale.values import choice, flag, instance, number

ROLES = ("policy", "reference", "critic", "reward", "engine")
DEFAULT_ROLES = ("policy", "reference", "engine")
"""GRPO's roles with a KL penalty: ``treadle plan``'s and ``treadle simulate``'s default."""
TRAINED = {"policy", "critic"}


def extra_forwards(roles: tuple[str, ...], old_logprobs: bool = True) -> int:
    """The forward passes besides the update's that ``roles`` run a step: the old policy's
    logprobs (1, unless ``old_logprobs`` is False: the engine's are trained on), a reference's
    logprobs, a critic's values and a reward model's scores (1 each, on the training GPUs, as
    verl's reward model worker runs)."""
    return old_logprobs + sum(r in roles for r in ("reference", "critic", "reward"))


@dataclass(frozen=True)
class Question:
    """What ``treadle plan`` is asked."""

    shape: ModelShape
    gpu: Gpu
    gpus: int
    work: Workload
    micro_batch: float = 1
    """Sequences per training pass per data-parallel rank; where ``work`` packs sequences
    (``pack_tokens``), each layout's packed micro-batch instead (:func:`packed_micro_batch`)."""
    roles: tuple[str, ...] = DEFAULT_ROLES
    """The roles that hold memory; a critic among them is also trained in the simulated steps
    (``Workload.critic``), whatever ``work`` says. The forwards besides the update's stay
    ``work.extra_forwards`` (the CLI derives them from the roles, :func:`extra_forwards`)."""
    recompute: Recompute | None = None
    """Activation checkpointing of the trained roles: their activations, and in the simulated
    steps the forward that ``full`` recomputes; None: ``work.recompute``'s (given, it replaces
    that)."""
    tp: int | None = None
    """Training tensor-parallel degree; None: the smallest that fits."""
    pp: int | None = None
    """Training pipeline stages; None: the fewest that fit."""
    sp: int | None = None
    """Training Ulysses sequence-parallel degree; None: the smallest that fits."""
    ep: int | None = None
    """A MoE model's training expert-parallel degree over the data-parallel ranks (Megatron's
    ``expert_model_parallel_size``); None: in each layout, the most that divides the ranks and
    the experts. Layouts whose data-parallel ranks it does not divide are left out."""
    zero: int = 3
    offload: bool = False
    """Colocated: the trainer's resident states go to host memory while the engine generates
    (``Setup.offload``), so the engine has the GPUs to itself."""

    def __post_init__(self) -> None:
        """Raises UserError naming a field of the wrong kind or range (a ``Question`` built in
        Python; the CLI checks its options first): the roles, a policy among them, each once;
        ``micro_batch`` up to a packed micro-batch's :data:`MAX_TOKENS` one-token sequences."""
        instance("Question.shape (MODEL)", self.shape, ModelShape)
        instance("Question.gpu (--gpu)", self.gpu, Gpu)
        instance("Question.work", self.work, Workload)
        number("Question.gpus (--gpus)", self.gpus, 1, MAX_GPUS, integer=True)
        number("Question.micro_batch (--micro-batch)", self.micro_batch, 0, MAX_TOKENS,
               above=True)  # fmt: skip
        for name in ("tp", "pp", "sp", "ep"):
            if getattr(self, name) is not None:
                number(f"Question.{name} (--{name})", getattr(self, name), 1, MAX_GPUS,
                       integer=True)  # fmt: skip
        number("Question.zero", self.zero, 0, 3, integer=True)
        flag("Question.offload (--offload)", self.offload)
        if self.recompute is not None:
            choice("Question.recompute (--recompute)", self.recompute, get_args(Recompute))
        roles = self.roles
        if (isinstance(roles, str) or "policy" not in roles or len(set(roles)) < len(roles)
                or set(roles) - set(ROLES)):  # fmt: skip
            raise UserError(f"Question.roles {roles!r} (--roles): a tuple of each of "
                            f"{', '.join(ROLES)} at most once, a policy among them")  # fmt: skip

    @property
    def checkpointing(self) -> Recompute:
        """The recompute that holds: ``recompute``, or the work's."""
        return self.recompute or self.work.recompute

    @property
    def seq(self) -> int:
        """Longest sequence: prompt + longest response (tokens)."""
        return self.work.prompt_tokens + self.work.lengths.max


@dataclass
class Placement:
    """One way to place the roles, with its memory per GPU and simulated step."""

    kind: str
    """``colocated`` or ``disaggregated``."""
    rollout_gpus: int
    train_gpus: int
    layout: Layout
    engine_tp: int
    mode: str
    moe: bool = False
    """Whether the model has experts: its labels name the expert-parallel degree, 1 too."""
    memory: list[Breakdown] = field(default_factory=list)
    """Per role, bytes per GPU of the GPUs that hold it."""
    train_peak: float = 0.0
    """Peak bytes per training GPU that must fit (colocated: the larger of the update phase
    and the rollout phase with the KV cache of one longest sequence)."""
    engine_peak: float = 0.0
    """Bytes per engine GPU as the engine holds them, its KV cache filling the share of the GPU
    it reserves (``kv_memory_fraction``, vLLM's gpu_memory_utilization); colocated: the rollout
    phase, the trainer's resident states beside it (what :func:`~treadle.scale.plots.memory`
    draws)."""
    fits: bool = False
    result: Result | None = None

    @property
    def resident(self) -> float:
        """Bytes a training GPU holds between passes: every training and forward-only role's
        parameter shards, gradients and optimizer states (what offloading moves)."""
        return sum(b.resident for b in self.memory if b.role != "engine")

    @property
    def has_engine(self) -> bool:
        """Whether the roles hold an engine (``--roles`` without one: training alone)."""
        return any(b.role == "engine" for b in self.memory)

    @property
    def label(self) -> str:
        """One line naming the placement, its split and layouts."""
        lay = self.layout
        if not self.has_engine:
            return f"training only | train {layout_name(lay, moe=self.moe)} zero{lay.zero}"
        split = "" if self.kind == "colocated" else f" {self.rollout_gpus}:{self.train_gpus}"
        return (
            f"{self.kind}{split} {self.mode} | train {layout_name(lay, moe=self.moe)} "
            f"zero{lay.zero} | "
            f"engine tp{self.engine_tp}"
        )


def layout_name(lay: Layout, dp: bool = True, compact: bool = False, moe: bool = False) -> str:
    """``dp8 tp1 pp1``, with `` sp4`` where sequence parallel and, for a MoE model (``moe``),
    its expert-parallel degree, `` ep8`` (``ep1`` too: the default is the most that divides)
    (``compact``: the degrees above 1 only, and a MoE model's ep, ``dp8 sp4 ep8``)."""
    degrees = [("dp", lay.dp)] if dp else []
    degrees += [("tp", lay.tp), ("pp", lay.pp), ("sp", lay.sp)] + ([("ep", lay.ep)] if moe else [])
    shown = {"dp", "ep"} | (set() if compact else {"tp", "pp"})
    return " ".join(f"{name}{n}" for name, n in degrees if n > 1 or name in shown)


def layout_options(lay: Layout) -> str:
    """The ``treadle simulate`` options of a trainer layout (``--train-sp`` where > 1)."""
    sp = f" --train-sp {lay.sp}" if lay.sp > 1 else ""
    return f"--train-tp {lay.tp} --train-pp {lay.pp}{sp}"


def measure(q: Question, p: Placement) -> Placement:
    """Fill in ``p``'s memory per role and whether it fits ``q.gpu``."""
    lora = q.work.lora_rank
    # the engine's own below; a LoRA policy's reference is its weights, adapters disabled
    roles = [r for r in q.roles if r != "engine" and not (lora and r == "reference")]
    seq = q.seq

    def size(role: str) -> Breakdown:
        """One role's memory per GPU: a reward model of its own shape sharded by FSDP over the
        training GPUs, apart from the trainer's model parallelism (verl's reward model worker
        has its own), so any trainer layout takes it."""
        shape, layout = q.shape, p.layout
        if role == "reward" and q.work.reward_shape is not None:
            shape = q.work.reward_shape
            layout = trainer_layout(shape, p.train_gpus, zero=p.layout.zero)
        return trainer(
            shape,
            layout,
            q.micro_batch,
            seq,
            q.checkpointing,
            role=role,
            trainable=role in TRAINED,
            lora_rank=lora if role == "policy" else 0,
        )

    p.memory = [size(r) for r in roles]
    states = p.resident
    update = update_phase(p.memory).total
    memory = q.gpu.memory_bytes
    fraction = q.gpu.efficiency.kv_memory_fraction
    beside = states if p.kind == "colocated" and not q.offload else 0.0  # beside the engine
    if "engine" in q.roles:
        budget = memory * fraction - beside
        eng = engine(q.shape, q.gpu, p.engine_tp, budget=budget)
        p.memory.append(eng)
        kv_needed = seq * kv_bytes_per_token(q.shape, p.engine_tp)
        engine_min = eng.parameters + eng.overhead + kv_needed
        p.engine_peak = eng.total
        engine_fits = eng.kv_cache >= kv_needed
    else:
        engine_min, engine_fits = 0.0, True
    if p.kind == "colocated":
        p.train_peak = max(update, beside + engine_min)
        p.engine_peak = beside + p.engine_peak if "engine" in q.roles else p.train_peak
    else:
        p.train_peak = update
    p.fits = engine_fits and p.train_peak <= memory
    return p


def candidates(q: Question) -> list[Placement]:
    """Colocated and disaggregated placements (rollout shares of 1/4, 1/2 and 3/4), each
    with the smallest training model- and sequence-parallel layout and engine TP that fit."""
    out = []
    for kind, rollout, train in _splits(q):
        placed = _smallest_fit(q, kind, rollout, train)
        if placed is not None:
            out.append(placed)
    return out


def _splits(q: Question) -> list[tuple[str, int, int]]:
    """(kind, rollout GPUs, training GPUs) of :func:`candidates`' placements: all of
    ``q.gpus`` colocated and, with an engine role, the rollout shares 1/4, 1/2 and 3/4."""
    splits = [("colocated", q.gpus, q.gpus)]
    if "engine" in q.roles and q.gpus >= 2:
        for share in (0.25, 0.5, 0.75):
            rollout = max(1, round(q.gpus * share))
            if 0 < rollout < q.gpus:
                splits.append(("disaggregated", rollout, q.gpus - rollout))
    return list(dict.fromkeys(splits))


def _measured(q: Question, kind: str, rollout: int, train: int, tp: int, pp: int,
              engine_tp: int, sp: int = 1, ep: int = 0) -> Placement:  # fmt: skip
    """:func:`measure` of one placement: the trainer in tp x pp x sp over ``train`` GPUs, data
    parallel (ZeRO ``q.zero``, experts sharded over ``ep`` of the data-parallel ranks, 0: the
    most that divide) over the rest."""
    layout = trainer_layout(q.shape, train, tp, pp, sp, q.zero, ep)
    mode = _mode(q, kind)
    if q.work.pack_tokens:  # fewer data-parallel ranks pack more of a step into a micro-batch
        q = replace(q, micro_batch=packed_micro_batch(q, layout))
    return measure(q, Placement(kind, rollout, train, layout, engine_tp, mode, q.shape.experts > 0))


def _mode(q: Question, kind: str) -> str:
    """How a placement's steps run: colocated ones, and any with ReMax's greedy baseline (its
    greedy pass uses the batch's policy), synchronous; disaggregated ones asynchronous."""
    return "sync" if kind == "colocated" or q.work.greedy_baseline else "async"


def packed_micro_batch(q: Question, layout: Layout) -> float:
    """Longest sequences' worth of tokens in a packed training micro-batch (fractional, at
    least 1): ``work.pack_tokens``, at most a data-parallel rank's share of an optimizer step
    (mean lengths) in ``layout``."""
    w = q.work
    share = w.batch * (w.prompt_tokens + w.lengths.mean) / (w.minibatches * layout.dp)
    return max(1.0, min(w.pack_tokens, share) / q.seq)


def _smallest_fit(q: Question, kind: str, rollout: int, train: int,
                  engine_tp: int | None = None) -> Placement | None:  # fmt: skip
    """The placement with the least parallelism that fits (fewest pipeline stages, then
    tensor-parallel ranks, then sequence-parallel ranks, then engine TP, or only
    ``engine_tp``), else the one tried that needs the least memory per training GPU (so a
    refusal can say how far it was)."""
    tps = [q.tp] if q.tp else [t for t in (1, 2, 4, 8) if q.shape.heads % t == 0]
    pps = [q.pp] if q.pp else [1, 2, 4, 8, 16]
    sps = [q.sp] if q.sp else [1, 2, 4, 8]
    engine_tps = [engine_tp] if engine_tp else [
        t for t in (1, 2, 4, 8, 16, 32, 64)
        if q.shape.heads % t == 0 and t <= rollout and engine_tp_splits_kv(q.shape, t)
    ]  # fmt: skip
    tried = None
    for pp, tp, sp in itertools.product(pps, tps, sps):
        if train % (tp * pp * sp) or pp > q.shape.layers or q.shape.heads % (tp * sp):
            continue
        if q.ep and train // (tp * pp * sp) % q.ep:  # the expert ranks split the data-parallel
            continue
        for etp in engine_tps or [1]:
            if rollout % etp:
                continue
            placed = _measured(q, kind, rollout, train, tp, pp, etp, sp, q.ep or 0)
            if placed.fits:
                return placed
            if tried is None or placed.train_peak < tried.train_peak:
                tried = placed
    return tried


def plan(q: Question, steps: int | None = 3, progress=None,
         names: Mapping[str, str] | None = None) -> list[Placement]:  # fmt: skip
    """The placements that fit, best first by simulated trained tokens per second:
    :func:`rank` of :func:`fitting` (see both; ``names`` as :func:`fitting` takes them).

    Raises:
        UserError: as :func:`fitting` does.
    """
    return rank(q, fitting(q, names), steps, progress)


def fitting(q: Question, names: Mapping[str, str] | None = None) -> list[Placement]:
    """The placements of :func:`candidates` that fit, not yet simulated. ``names``: the
    options a refusal names for "tp", "pp", "sp" and "ep" (default ``--tp``, ``--pp``,
    ``--sp``, ``--ep``; the CLI passes the spelling typed, ``--train-tp`` or ``--tp``).

    Raises:
        UserError: an explicit --tp, --pp, --sp or --ep the model cannot take, or no placement
            fits (says how many GPUs of this type the smallest fitting placement needs).
    """
    check_work(q.work)
    names = {n: f"--{n}" for n in ("tp", "pp", "sp", "ep")} | dict(names or {})
    if q.ep is not None:  # a degree the model cannot take comes first, whatever the GPUs
        _check_ep(q, names["ep"])
    if q.tp or q.pp or q.sp:
        check_layout(q.shape, Layout(tp=q.tp or 1, pp=q.pp or 1, sp=q.sp or 1), names, q.gpus)
        replica = (q.tp or 1) * (q.pp or 1) * (q.sp or 1)
        trains = [train for _, _, train in _splits(q)]
        if all(train % replica for train in trains):  # 10 GPUs take --tp 4 as 2:8
            raise UserError(_indivisible(q, replica, names, trains))
    fits = [p for p in candidates(q) if p.fits]
    if not fits:
        raise UserError(_nothing_fits(q, names["ep"]))
    return fits


def _indivisible(q: Question, replica: int, names: Mapping[str, str], trains: list[int]) -> str:
    """One line: the given layout takes ``replica`` GPUs at a time, which none of the training
    GPUs ``trains`` of ``q.gpus``' placements divides, and the fewest GPUs that a placement
    fits (:func:`_fewest_gpus`), if any (with a given expert-parallel degree, whose ranks the
    data-parallel ones must hold too)."""
    given = " x ".join(f"{names[n]} {v}" for n, v in (("tp", q.tp), ("pp", q.pp),
                                                       ("sp", q.sp)) if v)  # fmt: skip
    also = f"with {names['ep']} {q.ep}, " if (q.ep or 0) > 1 and q.shape.experts else ""
    fits = _fewest_gpus(q)
    shares = _listed([f"{n:,}" for n in trains])
    head = (f"{given} takes the trainer's GPUs {replica} at a time, which no placement's "
            f"training GPUs on --gpus {q.gpus:,} ({shares}) take")  # fmt: skip
    if fits is None:
        return f"{head}, and no placement fits up to {MAX_GPUS:,} GPUs either"
    return f"{head}: {also}use --gpus {fits}"


def rank(q: Question, fits: list[Placement], steps: int | None = 3,
         progress=None) -> list[Placement]:  # fmt: skip
    """``fits`` (placements of ``q``), each simulated for ``steps`` steps (None: to the steady
    state), best first by trained tokens per second (colocated: sync; disaggregated:
    asynchronous, staleness 1, partial rollouts, or sync with ReMax's greedy baseline; without
    an engine role, not simulated, by training memory per GPU). A MoE model's placement
    without ``q.ep`` is also simulated with its expert ranks within one node (the largest
    degree up to ``gpu.per_node / (tp x sp)``, the data-parallel ranks a node holds, that
    divides the ranks and the experts: its tokens' all-to-alls over NVLink, not the NICs)
    where that degree differs from the default and fits; the faster stands. Smaller degrees
    are not tried: the model costs the tokens' all-to-alls, which shrink with the degree, but
    not FSDP's all-gathers of the experts' weights, which grow as it falls (at ep 1 every
    rank gathers every expert), so it would always favour ep 1. ``progress(steps, error,
    label=...)`` hears of each simulated step: the steps run so far and the step time's
    relative error, for the placement ``label`` names."""
    work = replace(q.work, critic="critic" in q.roles, recompute=q.checkpointing)
    if "engine" not in q.roles:
        return sorted(fits, key=lambda p: p.train_peak)
    ranked = []
    for p in fits:
        show = None if progress is None else partial(progress, label=p.label.split(" |")[0])
        options = [p, *_within_a_node(q, p)]
        for option in options:
            option.result = simulate(q.shape, work, _setup(q, option), steps=steps,
                                     progress=show)  # fmt: skip
        ranked.append(max(options, key=lambda o: o.result.tokens_per_s))
    return sorted(ranked, key=lambda p: -p.result.tokens_per_s)


def _setup(q: Question, p: Placement) -> Setup:
    """The simulated setup of placement ``p`` of ``q``."""
    return Setup(
        q.gpu, p.rollout_gpus, p.train_gpus, colocated=p.kind == "colocated",
        engine_tp=p.engine_tp, train_tp=p.layout.tp, train_pp=p.layout.pp,
        train_sp=p.layout.sp, train_ep=p.layout.ep if q.shape.experts else 0,
        mode=p.mode, staleness=0 if p.mode == "sync" else 1, partial=p.mode == "async",
        offload=q.offload and p.kind == "colocated", offload_bytes=p.resident,
    )  # fmt: skip


def _within_a_node(q: Question, p: Placement) -> list[Placement]:
    """``p`` with a MoE model's expert ranks within one node (a node holds ``per_node / (tp x
    sp)`` data-parallel ranks, as :func:`~treadle.scale.costs.expert_alltoall_s` places them),
    where ``q`` gives no expert-parallel degree, that degree is not ``p``'s and it fits; else
    none."""
    lay = p.layout
    if not q.shape.experts or q.ep is not None:
        return []
    per_node = max(1, q.gpu.per_node // (lay.tp * lay.sp))
    ep = max(e for e in range(1, per_node + 1)
             if lay.dp % e == 0 and q.shape.experts % e == 0)  # fmt: skip
    if ep == lay.ep:
        return []
    other = _measured(q, p.kind, p.rollout_gpus, p.train_gpus, lay.tp, lay.pp, p.engine_tp,
                      lay.sp, ep)  # fmt: skip
    return [other] if other.fits else []


def _check_ep(q: Question, option: str) -> None:
    """Raises UserError for an expert-parallel degree ``q.ep`` (given as ``option``) that the
    model cannot take: any but 1 on a dense model, or one that does not divide its experts,
    naming the largest that do and that a placement of ``q`` fits at (else those that divide
    the data-parallel ranks ``q.gpus`` and its given --tp, --pp and --sp leave). Whether it
    divides a layout's data-parallel ranks, each layout says."""
    shape, ep = q.shape, q.ep
    if not shape.experts:
        if ep != 1:  # 1, Megatron's default, is no expert parallelism
            raise UserError(f"{option} {ep}: {shape.name} has no experts; leave {option} out")
        return
    if ep < 1 or shape.experts % ep:
        divisors = _ep_divisors(shape, q.gpus // ((q.tp or 1) * (q.pp or 1) * (q.sp or 1)))
        fits = [n for n in divisors if _fits(replace(q, ep=n))] or divisors
        raise UserError(
            f"{option} {ep} must divide {shape.name}'s {shape.experts} experts: use {option} "
            f"{' or '.join(map(str, fits[-4:]))}"
        )


def _ep_divisors(shape: ModelShape, most: int) -> list[int]:
    """The expert-parallel degrees up to ``most`` that divide ``shape``'s experts,
    ascending."""
    return [n for n in range(1, min(most, shape.experts) + 1) if shape.experts % n == 0]


def check_fits(q: Question, setup: Setup) -> Placement:
    """The memory per GPU of ``setup``'s placement as it stands (its training layout
    ``train_tp`` x ``train_pp`` x ``train_sp`` over the training GPUs, FSDP over the rest, and
    its engine TP), which ``treadle simulate`` runs.

    Raises:
        UserError: the trainer does not fit (says what it needs, and the --train-tp,
            --train-pp and --train-sp that fit these GPUs, if any, or that --offload or
            --recompute full would fit them as given), or a colocated engine's KV
            cache beside the trainer's states holds less than one sequence.
    """
    check(q.shape, q.work, setup)
    if setup.gpu != q.gpu:
        raise UserError(f"Setup.gpu {setup.gpu.name} is not Question.gpu {q.gpu.name}: one GPU "
                        "type sizes the memory and the steps")  # fmt: skip
    kind = "colocated" if setup.colocated else "disaggregated"
    p = _measured(q, kind, setup.rollout_gpus, setup.train_gpus, setup.train_tp, setup.train_pp,
                  setup.engine_tp, setup.train_sp, setup.train_ep)  # fmt: skip
    layout = p.layout
    if p.fits:
        return p
    memory = q.gpu.memory_bytes
    where = f"{q.shape.name} with {', '.join(q.roles)} at {q.seq:,} tokens per sequence"
    if q.work.pack_tokens:  # simulate's packed micro-batches: q.micro_batch sequences' worth
        where += f", packed {q.work.pack_tokens:,} tokens a micro-batch"
    if p.train_peak > memory:
        need, have = _two_sizes(p.train_peak, memory)
        fix = _what_fits(q, setup, kind)
        raise UserError(
            f"{where} needs {need} per training GPU in "
            f"{layout_name(layout, dp=False, moe=p.moe)} over "
            f"{setup.train_gpus} x {q.gpu.name} ({have}): {fix}"
        )
    raise UserError(  # colocated: the engine's KV cache beside the trainer's states
        f"{where}: beside the trainer's {p.resident / GIB:.1f} GiB of parameters, gradients "
        f"and optimizer states per GPU, an engine of --engine-tp {setup.engine_tp} on "
        f"{q.gpu.name} has no room for one sequence's KV cache: {_what_fits(q, setup, kind)}, "
        "or give the engines GPUs of their own (--rollout-gpus N)"
    )


def _keeps_ep(q: Question, kind: str, setup: Setup, other: Placement) -> bool:
    """Whether ``other``, a layout :func:`_what_fits` names, fits with the expert-parallel
    degree ``setup`` gives (it divides the layout's data-parallel ranks and the experts)."""
    ep, lay = setup.train_ep, other.layout
    if lay.dp % ep or q.shape.experts % ep:
        return False
    return _measured(q, kind, other.rollout_gpus, other.train_gpus, lay.tp, lay.pp,
                     other.engine_tp, lay.sp, ep).fits  # fmt: skip


def _what_fits(q: Question, setup: Setup, kind: str) -> str:
    """What a refusal of ``setup``'s trainer names: the least parallel trainer layout that fits
    (and the engine TP it needs, where the given one leaves too little room), then ``--offload``
    and ``--recompute full`` where either fits the layout as given; else ``treadle plan``."""
    free = replace(q, tp=None, pp=None, sp=None)
    other = _smallest_fit(free, kind, setup.rollout_gpus, setup.train_gpus, setup.engine_tp)
    engine = ""
    if other is None or not other.fits:  # the user's engine TP leaves too little room
        other = _smallest_fit(free, kind, setup.rollout_gpus, setup.train_gpus)
        engine = "" if other is None else f"--engine-tp {other.engine_tp} "
    fixes = [f"{engine}{layout_options(other.layout)}"] if other is not None and other.fits else []
    if fixes and setup.train_ep and not _keeps_ep(q, kind, setup, other):
        fixes[0] += f" --train-ep {other.layout.ep}"  # the degree it was sized at

    def as_given(changed: Question) -> bool:
        """Whether ``changed`` fits in the setup's own layout and engine TP."""
        return _measured(changed, kind, setup.rollout_gpus, setup.train_gpus, setup.train_tp,
                         setup.train_pp, setup.engine_tp, setup.train_sp,
                         setup.train_ep).fits  # fmt: skip

    # the trainer's states in host memory while the engine generates; each layer recomputed
    if kind == "colocated" and not q.offload and as_given(replace(q, offload=True)):
        fixes.append("--offload")
    if q.checkpointing != "full" and as_given(replace(q, recompute="full")):
        fixes.append("--recompute full")
    text = (f"{fixes[0]} fits" + "".join(f", or {f}" for f in fixes[1:]) if fixes else
            "`treadle plan` with this model, options and --gpus N lists what fits")  # fmt: skip
    if q.work.pack_tokens and "--offload" not in fixes:
        text += ", or pack fewer tokens a micro-batch (--pack-tokens)"
    return text


def _two_sizes(need: float, have: float) -> tuple[str, str]:
    """``need`` and ``have`` (bytes) in GiB, with as many decimals (1 to 3) as tell them
    apart."""
    for decimals in (1, 2, 3):
        a, b = f"{need / GIB:.{decimals}f} GiB", f"{have / GIB:.{decimals}f} GiB"
        if a != b:
            break
    return a, b


MAX_GPUS = 16384
"""The most GPUs a refusal searches for a placement that fits."""


def _fits(q: Question) -> bool:
    """Whether any placement of :func:`candidates` fits ``q``."""
    return any(p.fits for p in candidates(q))


def _fewest_gpus(q: Question) -> int | None:
    """The fewest GPUs of ``q``'s type above ``q.gpus`` that a placement fits, if any up to
    MAX_GPUS: every count to 64, then whole nodes (to 1,024, and beyond it between the steps
    of 1,024 where one of those fits)."""
    node = q.gpu.per_node
    counts = [*range(1, 65), *range(64 + node, 1025, node), *range(2048, MAX_GPUS + 1, 1024)]
    below = q.gpus
    for n in (n for n in counts if n > q.gpus):
        if _fits(replace(q, gpus=n)):
            whole = range(below - below % node + node, n, node)  # the nodes between the steps
            return next((m for m in whole if m > q.gpus and _fits(replace(q, gpus=m))), n)
        below = n
    return None


def _searched(q: Question) -> str:
    """The trainer layouts :func:`_smallest_fit` tries, in words, for a refusal that says none
    fits: those ``q`` leaves to it, and the options that try others."""
    free = [n for n, given in (("tp", q.tp), ("sp", q.sp)) if not given]
    parts = ([f"{_listed(free)} of 1, 2, 4 or 8"] if free else []) + (
        ["pp of 1, 2, 4, 8 or 16"] if not q.pp else [])  # fmt: skip
    options = _listed([f"--{n}" for n in ("tp", "pp", "sp") if not getattr(q, n)])
    verb = "tries" if " " not in options else "try"
    return f" with {', '.join(parts)} ({options} {verb} others)" if parts else ""


def _listed(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 2 else items)


def _nothing_fits(q: Question, ep_option: str = "--ep") -> str:
    """One line: what does not fit, and the smallest GPU count of this type that would
    (:func:`_fewest_gpus`), if any; with the expert-parallel degree given (as ``ep_option``),
    where it holds."""
    fits = _fewest_gpus(q)  # a count where a placement fits: fitting() takes it, layout given
    tried = candidates(q)
    best = min(tried, key=lambda p: p.train_peak, default=None)
    need = ""
    if not tried and q.ep and q.shape.experts:  # no layout's data-parallel ranks take it
        need = (f"; no trainer layout on {q.gpus} GPUs has data-parallel ranks that "
                f"{ep_option} {q.ep} divides")  # fmt: skip
    if best is not None and best.train_peak > q.gpu.memory_bytes:
        need = f"; the closest needs {best.train_peak / GIB:.1f} GiB a training GPU ({best.label})"
    elif best is not None:  # the trainer fits; the engine's cache does not hold a sequence
        need = (
            f"; the closest's trainer fits ({best.train_peak / GIB:.1f} GiB) but its "
            f"engines' KV cache cannot hold one sequence beside their weights ({best.label})"
        )
    roles = ", ".join(q.roles)
    given_ep = f" and {ep_option} {q.ep}" if q.ep and q.shape.experts else ""
    where = (f"it fits {fits:,} GPUs" if fits else
             f"no placement{_searched(q)} fits up to {MAX_GPUS:,} GPUs either")  # fmt: skip
    # only what fits as given: each change not already made alone, then both; first another
    # expert-parallel degree (the largest that fits), where one was given
    changes = {}
    if given_ep:
        eps = reversed(_ep_divisors(q.shape, q.gpus))
        ep = next((e for e in eps if e != q.ep and _fits(replace(q, ep=e))), None)
        changes |= {f"{ep_option} {ep}": {"ep": ep}} if ep else {}
    if not q.offload:
        changes["--offload"] = {"offload": True}
    if q.checkpointing != "full":
        changes["--recompute full"] = {"recompute": "full"}
    if "--offload" in changes and "--recompute full" in changes:
        changes["--offload --recompute full"] = {"offload": True, "recompute": "full"}
    fix = next((k for k, v in changes.items() if _fits(replace(q, **v))), None)
    # shorter sequences, where the shortest fits (a model whose states alone overflow, not)
    tiny = replace(q, work=replace(q.work, prompt_tokens=1, lengths=Lengths(1, 1)), micro_batch=1)
    smaller = q.micro_batch > 1 and _fits(replace(q, micro_batch=1))
    lower = (["--max-response", "--prompt-tokens"] if _fits(tiny) else []) + (
        ["--micro-batch"] if smaller else [])  # fmt: skip
    lower_text = f"; or lower {' or '.join(lower)}" if lower else ""
    return (
        f"{q.shape.name} with {roles} at {q.seq:,} tokens per sequence{given_ep} does not fit "
        f"{q.gpus:,} x {q.gpu.name} ({q.gpu.memory_gib:.1f} GiB) in any placement{need}: {where}"
        + (f", or use {fix} on these" if fix else "")
        + lower_text
    )
