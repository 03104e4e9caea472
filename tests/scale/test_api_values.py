"""treadle.scale's Python API refuses what its CLI's parsers never give (a NaN, a negative time,
a float where a count is meant, a name outside its choices) with a UserError naming the field
and its option, where it returned negative step times, NaN or a traceback (a review of
2026-12-07)."""

import math
from dataclasses import replace

import pytest

from treadle.core.errors import UserError
from treadle.scale.hardware import gpu
from treadle.scale.memory import Layout, engine, trainer
from treadle.scale.plan import Question, check_fits, fitting
from treadle.scale.shapes import NAMED
from treadle.scale.simulate import Lengths, Setup, Workload, simulate

SHAPE = NAMED["qwen2.5-0.5b"]
H100 = gpu("h100")
WORK = Workload(8, 4, 100, Lengths(200, 400))
COLOCATED = Setup(H100, 4, 4, colocated=True)
ASYNC = Setup(H100, 2, 2, mode="async", staleness=1, partial=True)


def _refused(call, says):
    """``call()`` raises UserError, its message holding ``says``."""
    with pytest.raises(UserError) as refused:
        call()
    assert says in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    ("work", "setup", "says"),
    [
        # each returned a step time of its own before: -0.476 s, NaN, a negative update, ...
        (replace(WORK, reward_s=-5), COLOCATED, "Workload.reward_s (--reward-seconds) -5: must"),
        (replace(WORK, reward_s=math.nan), COLOCATED, "Workload.reward_s (--reward-seconds) nan"),
        (replace(WORK, reward_s=math.inf), COLOCATED, "Workload.reward_s (--reward-seconds) inf"),
        (replace(WORK, extra_forwards=-5), COLOCATED, "Workload.extra_forwards (--extra-forw"),
        (replace(WORK, minibatches=0), COLOCATED, "Workload.minibatches (--minibatches) 0"),
        (replace(WORK, samples_per_prompt=2.5), COLOCATED, "Workload.samples_per_prompt (--sam"),
        (replace(WORK, prompts=8.5), COLOCATED, "Workload.prompts (--prompts) 8.5: must be an"),
        (replace(WORK, recompute="bogus"), COLOCATED, "Workload.recompute (--recompute) 'bogus'"),
        (replace(WORK, lengths=Lengths(200, 400, -1)), COLOCATED, "Lengths.sigma (--length-sig"),
        (replace(WORK, lengths=Lengths(200, 400, math.nan)), COLOCATED, "Lengths.sigma (--le"),
        (replace(WORK, lengths=Lengths(200, 400.5)), COLOCATED, "Lengths.max (--max-response)"),
        (
            WORK,
            replace(COLOCATED, offload=True, offload_bytes=-1e12),
            "Setup.offload_bytes (sized by --offload) -1000000000000.0",
        ),
        # an int past a float's range: OverflowError from the messages' own formatting before
        (WORK, replace(ASYNC, staleness=10**400), "Setup.staleness (--staleness) 1000"),
        (WORK, replace(ASYNC, oversample=-0.5), "Setup.oversample (--oversample) -0.5: must"),
        (WORK, replace(ASYNC, oversample=math.nan), "Setup.oversample (--oversample) nan"),
        (WORK, replace(ASYNC, mode="bogus"), "Setup.mode (--mode) 'bogus': must be one of"),
        (WORK, replace(ASYNC, engine_tp=2.0), "Setup.engine_tp (--engine-tp) 2.0: must be an"),
        (WORK, replace(ASYNC, updates_per_sync=2.0), "Setup.updates_per_sync (--updates-per"),
        (WORK, replace(ASYNC, partial=1), "Setup.partial 1: must be True or False"),
    ],
)
def test_simulate_refuses_a_field_naming_it(work, setup, says):
    _refused(lambda: simulate(SHAPE, work, setup, steps=2), says)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"train_mfu": -0.4}, "Efficiency.train_mfu -0.4: must be a finite number above 0 and at "
         "most 1"),
        ({"decode_bandwidth": 0.0}, "Efficiency.decode_bandwidth 0.0"),
        ({"max_batch": 0}, "Efficiency.max_batch 0: must be an integer in 1..1,048,576"),
        ({"sync_overhead_s": -5}, "Efficiency.sync_overhead_s -5: must be a finite number in 0"),
    ],
)  # fmt: skip
def test_a_gpu_refuses_an_efficiency_out_of_range(fields, says):
    # a train_mfu of -0.4 gave an update of -0.064 s; 0 a ZeroDivisionError; max_batch 0 the
    # simulator's own "stalled: no event left" (a bug, not input)
    _refused(lambda: gpu("h100", **fields), says)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"heads": 0}, "qwen2.5-0.5b: heads 0: must be an integer in 1..1,048,576"),
        ({"kv_heads": 3}, "qwen2.5-0.5b: kv_heads 3 must divide heads 14"),
        ({"intermediate": -100000}, "qwen2.5-0.5b: intermediate -100000"),
        ({"experts": 8, "experts_active": 9, "expert_intermediate": 64}, "experts_active 9: must"),
        ({"experts": 8, "experts_active": 2, "expert_intermediate": 64, "dense_layers": 25},
         "dense_layers 25: must be an integer in 0..24"),
    ],
)  # fmt: skip
def test_a_model_shape_refuses_sizes_no_model_has(fields, says):
    # Qwen2.5-0.5B: 24 layers, 14 heads, 2 KV heads; an intermediate of -100,000 gave a
    # placement of -26.9 GiB, a KV head count of 0 a ZeroDivisionError
    _refused(lambda: replace(SHAPE, **fields), says)


def test_check_fits_runs_simulates_checks_first():
    # train_pp -1 reported a peak of -103.2 GiB as fitting; engine TP 7 over 4 KV heads fitted
    q = Question(NAMED["qwen2.5-7b"], H100, 8, Workload(64, 8, 300, Lengths(1500, 8000)))
    with pytest.raises(UserError, match=r"--train-pp -1 x --train-sp 1 must be at least 1 each"):
        check_fits(q, Setup(H100, 8, 8, colocated=True, train_pp=-1))
    with pytest.raises(UserError, match=r"--engine-tp 7 does not divide --gpus 8"):
        check_fits(q, Setup(H100, 8, 8, colocated=True, engine_tp=7))
    # and a setup it takes still fits: Qwen2.5-7B colocated on 8 H100s
    assert check_fits(q, Setup(H100, 8, 8, colocated=True)).fits


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"micro_batch": -4}, "Question.micro_batch (--micro-batch) -4: must be a finite number "
         "above 0"),
        ({"gpus": 0}, "Question.gpus (--gpus) 0: must be an integer in 1..16,384"),
        ({"gpus": 8.5}, "Question.gpus (--gpus) 8.5"),
        ({"pp": -1}, "Question.pp (--pp) -1"),
        ({"tp": 0}, "Question.tp (--tp) 0"),
        ({"zero": 5}, "Question.zero 5: must be an integer in 0..3"),
        ({"roles": ("reference", "engine")}, "a policy among them"),
        ({"roles": ("policy", "policy")}, "a policy among them"),
        ({"roles": ("policy", "judge")}, "a policy among them"),
    ],
)  # fmt: skip
def test_a_question_refuses_fields_no_placement_answers(fields, says):
    # micro_batch -4 gave a placement of -4.8 GiB; gpus 0 "dp1 sp4" placements; tp 0 "auto"
    given = {"shape": SHAPE, "gpu": H100, "gpus": 8, "work": WORK, **fields}
    _refused(lambda: fitting(Question(**given)), says)


def test_a_layout_refuses_an_expert_degree_its_ranks_cannot_hold():
    # 8 data-parallel ranks cannot each hold 1/128 of the experts: it gave 11.9 GiB a GPU
    moe = NAMED["qwen3-30b-a3b"]
    assert trainer(moe, Layout(dp=8, ep=8), 1, 1000).total > 0
    with pytest.raises(UserError, match=r"expert parallel 128 does not divide the 8 data-par"):
        trainer(moe, Layout(dp=8, ep=128), 1, 1000)
    with pytest.raises(UserError, match=r"Layout.pp -1: must be an integer"):
        trainer(moe, Layout(dp=8, pp=-1), 1, 1000)


def test_numpy_scalars_are_numbers_and_bools_are_flags_not_counts():
    # a sweep over np.arange passes NumPy's scalars: they ran before the checks, and still do
    np = pytest.importorskip("numpy")
    work = Workload(np.int64(8), 4, 100, Lengths(np.float32(200), 400))
    setup = Setup(H100, np.int64(4), 4, colocated=np.bool_(True))
    numpy = simulate(SHAPE, work, setup, steps=2)
    assert numpy.step_s == simulate(SHAPE, WORK, COLOCATED, steps=2).step_s
    with pytest.raises(UserError, match=r"Workload.prompts \(--prompts\) True: must be an int"):
        simulate(SHAPE, replace(WORK, prompts=True), COLOCATED, steps=2)
    with pytest.raises(UserError, match=r"Workload.prompts \(--prompts\) an integer of over 4,3"):
        simulate(SHAPE, replace(WORK, prompts=10**5000), COLOCATED, steps=2)


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda: simulate(SHAPE, WORK, COLOCATED, steps=True), "steps (--steps) True: must be"),
        (lambda: simulate(SHAPE, WORK, COLOCATED, steps=0), "steps (--steps) 0: must be an "
         "integer in 1..64"),
        (lambda: simulate(SHAPE, WORK, COLOCATED, steps=10**9), "steps (--steps) 1000000000"),
        (lambda: simulate(SHAPE, WORK, COLOCATED, steps=4, window=(1.5, 3)), "window (--avera"),
        (lambda: simulate(SHAPE, WORK, replace(COLOCATED, gpu="h100"), 2), "Setup.gpu (--gpu) "
         "'h100': must be a Gpu"),
        (lambda: simulate(SHAPE, replace(WORK, lengths=None), COLOCATED, 2), "Workload.lengths "
         "None: must be a Lengths"),
        (lambda: simulate(SHAPE, replace(WORK, lengths=Lengths(200, 400, measured=((-50, 9),))),
                          COLOCATED, 2), "Lengths.measured[0] -50: must be an integer in 0.."),
        (lambda: fitting(Question(SHAPE, H100, 8, WORK, roles="policy")), "Question.roles "
         "'policy' (--roles): a tuple"),
        (lambda: check_fits(Question(SHAPE, gpu("h20"), 4, WORK), COLOCATED), "Setup.gpu h100 is "
         "not Question.gpu h20"),
        (lambda: engine(NAMED["qwen3-30b-a3b"], H100, 1, ep=-1), "engine's ep -1: must be an "
         "integer in 1..128"),
        (lambda: trainer(SHAPE, Layout(), 1, 100, lora_rank=-64), "lora_rank (--lora-rank) -64"),
        (lambda: trainer(SHAPE, Layout(), math.nan, 100), "micro_batch (--micro-batch) nan"),
        (lambda: trainer(SHAPE, Layout(), 1, 100, recompute="x"), "recompute (--recompute) 'x'"),
    ],
)  # fmt: skip
def test_the_other_entry_points_refuse_by_name(call, says):
    # each gave a traceback, a negative size (engine ep -1: -51.1 GiB of weights) or ran
    _refused(call, says)


def test_a_packed_micro_batch_of_many_short_sequences_is_no_micro_batch_option():
    # --pack-tokens 1,000,000 over 32-token sequences packs 31,250 of them a micro-batch: a
    # derived size, not --micro-batch's 1..4,096 (the first checks refused it, naming
    # --micro-batch, which simulate has not)
    work = Workload(512, 16, 16, Lengths(16, 16, 0.0), pack_tokens=1_000_000, recompute="full")
    q = Question(SHAPE, H100, 8, work, roles=("policy", "engine"))
    assert check_fits(q, Setup(H100, 8, 8, colocated=True)).fits
