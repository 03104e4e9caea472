"""DeepSpeed ZeRO-1/2/3 (treadle.train.deepspeed_backend) against the single-process
TorchBackend: the same loss, gradients, grad norm and updated weights after one optimizer step
on the same batch, at world 1 in this process and at world 2 (two spawned gloo ranks, each
given half the samples with the step-wide denominators, as treadle's trainer group does); a
checkpoint round trip through ``torch.save``/``torch.load(weights_only=True)``; no DeepSpeed
op compiled by fresh processes on an empty ``TORCH_EXTENSIONS_DIR``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/install.sh)")

from contracts.test_training_backend import batch
from integration.tiny import build_tiny_folder

from treadle.config import AlgorithmConfig, DeepSpeedConfig, TrainerConfig
from treadle.core.batch import StepTotals
from treadle.core.errors import UserError
from treadle.store.models import load_model
from treadle.train.objectives import PolicyObjective
from treadle.train.packing import plan
from treadle.train.torch_backend import TorchBackend

# grad_clip 0.02 is below the batch's grad norm (0.048): clipping is exercised. lr 1e-3: Adam's
# first step is lr * g / (|g| + 1e-8) elementwise, so a weight whose gradient is ~1e-8 moves by
# up to lr for a 1e-9 difference in g; at 1e-3 ZeRO-3's reduce-scatter order (measured 2.6e-5
# at lr 1e-2) stays under the 1e-5 asked.
TRAINER = TrainerConfig(lr=1e-3, weight_decay=0.1, micro_batch_tokens=24, grad_clip=0.02)
POLICY = PolicyObjective.from_config(AlgorithmConfig(), max_tokens=8)
FULL_ZERO3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
"""ZeRO-3 partitions every tensor of the tiny model (by default ones under 1e5 elements stay
whole on each rank)."""
TOL = 1e-5


def staged(stage: int, bf16: bool = False) -> TrainerConfig:
    zero = DeepSpeedConfig(zero_stage=stage)
    return dataclasses.replace(TRAINER, deepspeed=zero, bf16_autocast=bf16)


def deepspeed_backend(folder: Path, stage: int, bf16: bool = False):
    from treadle.train.deepspeed_backend import DeepSpeedBackend

    cfg = staged(stage, bf16)
    return DeepSpeedBackend(load_model(folder)[0], cfg, 10, ds_extra=FULL_ZERO3)


def one_step(backend, samples, **kwargs) -> dict:
    """One optimizer step; its loss, grad norm, the gradients (Adam's first moment after step
    1 is (1 - beta1) g), second moments and the weights after it (all gathered)."""
    metrics = backend.optimizer_step(samples, POLICY, **kwargs)
    state = backend.optimizer_state().optimizer["state"]
    beta1 = TRAINER.betas[0]
    return {
        "loss": float(metrics["loss"]),
        "grad_norm": float(metrics["grad_norm"]),
        "grads": [state[i]["exp_avg"] / (1 - beta1) for i in sorted(state)],
        "exp_avg_sq": [state[i]["exp_avg_sq"] for i in sorted(state)],
        "weights": dict(backend.named_weights()),
    }


def max_abs(a: list | dict, b: list | dict) -> float:
    pairs = (
        zip(a.values(), b.values(), strict=True) if isinstance(a, dict) else zip(a, b, strict=True)
    )
    return max((x - y).abs().max().item() for x, y in pairs)


def assert_same_step(got: dict, want: dict) -> None:
    assert abs(got["loss"] - want["loss"]) < TOL
    assert abs(got["grad_norm"] - want["grad_norm"]) < TOL
    assert len(got["grads"]) == len(want["grads"])
    assert max_abs(got["grads"], want["grads"]) < TOL
    assert max_abs(got["exp_avg_sq"], want["exp_avg_sq"]) < TOL
    assert got["weights"].keys() == want["weights"].keys()
    assert max_abs(got["weights"], want["weights"]) < TOL


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("deepspeed") / "model"
    build_tiny_folder(path)
    return path


@pytest.fixture(scope="module")
def torch_step(folder) -> dict:
    """The single-process TorchBackend's step on the batch, and the weights before it."""
    torch.set_num_threads(1)
    backend = TorchBackend(load_model(folder)[0], TRAINER, 10)
    before = {n: t.clone() for n, t in backend.named_weights()}
    out = one_step(backend, batch())
    assert out["grad_norm"] > TRAINER.grad_clip  # the clipping is exercised
    return out | {"before": before}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_world_1_step_is_the_torch_backends(stage, folder, torch_step, one_torch_thread):
    backend = deepspeed_backend(folder, stage)
    assert len(backend._micro_batches(batch())) == 3  # accumulation over 3 micro-batches
    got = one_step(backend, batch())
    assert_same_step(got, torch_step)
    unchanged = [n for n, t in got["weights"].items() if torch.equal(t, torch_step["before"][n])]
    assert unchanged == []  # every parameter moved


def _rank(rank: int, init: str, folder: Path, out: Path) -> None:
    """One of two gloo ranks: half the samples, the whole step's denominators, the same
    number of micro-batches on both ranks (a masked filler pads), the loss scaled by the world
    size (ZeRO averages gradients over ranks; the step's loss is their sum)."""
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    from treadle.cluster.trainer_group import filler_of

    samples = batch()
    mine = samples[rank::2]
    totals = StepTotals(sum(sum(s.loss_mask) for s in samples), sum(1 for _ in samples))
    counts = [len(plan(samples[r::2], TRAINER.micro_batch_tokens, "shared")) for r in (0, 1)]
    results = {}
    for stage in (1, 2, 3):
        backend = deepspeed_backend(folder, stage)
        assert backend.packing == "shared"
        results[stage] = one_step(
            backend,
            mine,
            totals=totals,
            micro_batches=max(counts),
            filler=filler_of(samples[0]),
            loss_scale=2.0,
        )
        backend.engine.destroy()
    torch.save(results, out / f"rank{rank}.pt")
    _leave()


def _leave() -> None:
    """End a spawned rank once its results are saved: destroy the process group, then exit
    without the interpreter's finalization. A ZeRO-3 engine stays referenced by the hooks it
    registered even after ``engine.destroy()`` (measured: ZeRO-1 and 2 engines are collected,
    ZeRO-3's are not), so its gloo state was torn down only while the interpreter died, where
    PyTorch's gloo work objects take the GIL (pytorch/pytorch#179291): a rank aborted with
    "terminate called without an active exception" (SIGABRT) in one CI run, after its last
    collective. ``os._exit(0)`` after the results are on disk is a clean exit for
    ``torch.multiprocessing.spawn`` (exit code 0)."""
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.slow
def test_world_2_steps_are_the_torch_backends(folder, torch_step, tmp_path):
    # Every sample has a trained token, so StepTotals' sequences is the batch size (6).
    assert all(any(s.loss_mask) for s in batch())
    init = f"file://{tmp_path / 'rendezvous'}"
    # Fresh processes (DeepSpeed builds its comm backend once per process) on an empty
    # extensions folder: the shm comm op (a ~5-minute JIT build) must not be built.
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    env = {"OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(extensions)}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        torch.multiprocessing.spawn(_rank, (init, folder, tmp_path), nprocs=2, join=True)
    assert list(extensions.iterdir()) == []  # nothing compiled
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for stage in (1, 2, 3):
        got = dict(ranks[0][stage])
        # each rank reports its share of the loss: the step's loss is their sum
        got["loss"] = ranks[0][stage]["loss"] + ranks[1][stage]["loss"]
        assert_same_step(got, torch_step)
        assert max_abs(ranks[1][stage]["weights"], got["weights"]) == 0.0  # one model


@pytest.mark.parametrize("stage, bf16", [(2, False), (3, False), (1, True)])  # 1, bf16:
def test_a_checkpoint_resumes_to_the_same_next_loss(  # DeepSpeed's BF16_Optimizer
    stage, bf16, folder, tmp_path, one_torch_thread
):
    samples = batch()
    backend = deepspeed_backend(folder, stage, bf16)
    backend.train_step(samples, POLICY)
    backend.save_pretrained(tmp_path / "ckpt")
    load_model(folder)[1].save_pretrained(tmp_path / "ckpt")  # as a checkpoint holds it
    state = backend.optimizer_state()
    torch.save({"optimizer": state.optimizer, "scheduler": state.scheduler}, tmp_path / "t.pt")
    backend.train_step(samples, POLICY)  # its update reads the moments
    expected = float(backend.train_step(samples, POLICY)["loss"])  # of the weights after it
    resumed = deepspeed_backend(tmp_path / "ckpt", stage, bf16)
    saved = torch.load(tmp_path / "t.pt", weights_only=True)  # as treadle's checkpoints load
    from treadle.core.protocols import OptimizerState

    resumed.load_optimizer_state(OptimizerState(saved["optimizer"], saved["scheduler"]))
    assert resumed.scheduler.last_epoch == 1  # one step taken: the schedule continues
    resumed.train_step(samples, POLICY)
    assert abs(float(resumed.train_step(samples, POLICY)["loss"]) - expected) < 1e-6


def test_the_optimizer_state_moves_between_the_backends(folder, one_torch_thread):
    """The gathered layout is torch's own: a TorchBackend's state resumes under ZeRO-2 and
    ZeRO-2's under a TorchBackend, moments bit for bit."""
    ref = TorchBackend(load_model(folder)[0], TRAINER, 10)
    ref.train_step(batch(), POLICY)
    backend = deepspeed_backend(folder, 2)
    backend.load_optimizer_state(copy.deepcopy(ref.optimizer_state()))
    back = TorchBackend(load_model(folder)[0], TRAINER, 10)
    back.load_optimizer_state(backend.optimizer_state())
    assert back.scheduler.last_epoch == 1
    assert back.optimizer.param_groups[0]["lr"] == ref.optimizer.param_groups[0]["lr"]
    for i, (got, want) in enumerate(
        zip(back.optimizer.state.values(), ref.optimizer.state.values(), strict=True)
    ):
        assert float(got["step"]) == float(want["step"]) == 1.0, i
        assert torch.equal(got["exp_avg"], want["exp_avg"]), i
        assert torch.equal(got["exp_avg_sq"], want["exp_avg_sq"]), i


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_trains_bf16_weights_with_fp32_masters(stage, folder, torch_step, one_torch_thread):
    """DeepSpeed's bf16 mode: the model computes in bf16, the named weights are the fp32
    masters. Against the torch backend's fp32 step: the loss within 1e-4 (bf16's 8-bit
    mantissa over 3 micro-batches measured 2e-6), the gradients within 2% of the largest
    (measured 0.7%)."""
    backend = deepspeed_backend(folder, stage, bf16=True)
    assert next(backend.model.parameters()).dtype == torch.bfloat16
    got = one_step(backend, batch())
    assert {t.dtype for t in got["weights"].values()} == {torch.float32}
    assert abs(got["loss"] - torch_step["loss"]) < 1e-4
    largest = max(g.abs().max().item() for g in torch_step["grads"])
    assert max_abs(got["grads"], torch_step["grads"]) < 0.02 * largest
    from deepspeed import zero

    with zero.GatheredParameters(list(backend.model.parameters()), enabled=stage == 3):
        bf16 = {n: t.float() for n, t in backend.model.state_dict().items()}
    assert max_abs(bf16, got["weights"]) < 2**-8 * max(t.abs().max() for t in bf16.values())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_micro_batch_gradients_add_up_in_fp32(stage, one_torch_thread):
    """A weight w of a loss c * w gets gradient c. Micro-batches with c = 1, then four with
    c = 2^-9 (each exact in bf16): in fp32 they add up to 1 + 4 * 2^-9 = 1.0078125; in bf16
    each 2^-9 is half an ulp of 1 (2^-8 wide near 1), rounds to even and is lost: 1.0 (measured
    with DeepSpeed's default, ``grad_accum_dtype`` the model's). Adam's first moment after step
    1 is (1 - beta1) g = 0.1 g."""
    from deepspeed.utils import safe_get_full_optimizer_state

    from treadle.train.deepspeed_backend import (
        _forget_destroyed_groups,
        ds_config,
        import_deepspeed,
        init_single_process_group,
    )

    deepspeed = import_deepspeed()
    model = torch.nn.Linear(1, 1, bias=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    init_single_process_group()
    _forget_destroyed_groups()
    config = ds_config(dataclasses.replace(staged(stage, bf16=True), grad_clip=0.0))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    for c in [1.0, 2**-9, 2**-9, 2**-9, 2**-9]:
        out = engine(torch.ones(1, 1, dtype=torch.bfloat16))
        engine.backward(out.sum() * c, scale_wrt_gas=False)  # as DeepSpeedBackend.backward
    engine.step()
    (w,) = model.parameters()
    assert safe_get_full_optimizer_state(w, "exp_avg").item() == pytest.approx(0.1 * 1.0078125)


def _bf16_rank(rank: int, init: str, out: Path) -> None:
    """One of two gloo ranks of the toy above: micro-batches c = [1, 2^-9, 2^-9] on rank 0,
    [3, 2^-9, 2^-9] on rank 1; Adam's first moment per ZeRO stage."""
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    from deepspeed.utils import safe_get_full_optimizer_state

    from treadle.train.deepspeed_backend import (
        _forget_destroyed_groups,
        ds_config,
        import_deepspeed,
    )

    deepspeed = import_deepspeed()
    moments = {}
    for stage in (1, 2, 3):
        model = torch.nn.Linear(1, 1, bias=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _forget_destroyed_groups()
        config = ds_config(dataclasses.replace(staged(stage, bf16=True), grad_clip=0.0))
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        for c in [1.0 + 2.0 * rank, 2**-9, 2**-9]:
            y = engine(torch.ones(1, 1, dtype=torch.bfloat16))
            engine.backward(y.sum() * c, scale_wrt_gas=False)
        engine.step()
        (w,) = model.parameters()
        moments[stage] = safe_get_full_optimizer_state(w, "exp_avg").item()
        engine.destroy()
    torch.save(moments, out / f"rank{rank}.pt")
    _leave()


@pytest.mark.slow
def test_bf16_gradients_are_averaged_over_ranks_in_fp32(tmp_path):
    """Each rank's fp32 sum (1 + 2^-8 and 3 + 2^-8) averaged over the 2 ranks: 2 + 2^-8 =
    2.00390625, Adam's first moment 0.1 of it. Reduced in bf16 (ZeRO-1's BF16_Optimizer
    without ``communication_data_type: fp32``, measured) the 2^-8 is lost: 0.2."""
    init = f"file://{tmp_path / 'rendezvous'}"
    torch.multiprocessing.spawn(_bf16_rank, (init, tmp_path), nprocs=2, join=True)
    for rank in (0, 1):
        moments = torch.load(tmp_path / f"rank{rank}.pt")
        assert moments == {s: pytest.approx(0.1 * 2.00390625, rel=1e-7) for s in (1, 2, 3)}


def test_a_bf16_policy_and_its_kl_reference_score_alike_before_training(folder, one_torch_thread):
    """The frozen reference under DeepSpeed bf16 holds the policy's bf16 weights (not fp32
    weights autocast to bf16), so before any step their logprobs are the same bit for bit and
    the KL term starts at 0 (with fp32 reference weights they differed by up to 2.7e-3 here)."""
    from treadle.train.backends import build_backend

    policy = deepspeed_backend(folder, 2, bf16=True)
    cfg = dataclasses.replace(staged(2, bf16=True), backend="deepspeed")
    reference = build_backend(load_model(folder)[0], cfg, 1, trainable=False)
    assert next(reference.model.parameters()).dtype == torch.bfloat16
    samples = batch()
    assert reference.compute_logprobs(samples) == policy.compute_logprobs(samples)


def test_an_optimizer_state_of_another_model_is_refused(folder, one_torch_thread):
    backend = deepspeed_backend(folder, 1)
    state = backend.optimizer_state()
    state.optimizer["param_groups"][0]["params"].pop()
    with pytest.raises(ValueError, match="another model"):
        backend.load_optimizer_state(state)


def test_offload_without_cuda_is_refused():
    from treadle.train.deepspeed_backend import ds_config

    cfg = dataclasses.replace(TRAINER, deepspeed=DeepSpeedConfig(offload_optimizer=True))
    if torch.cuda.is_available():
        assert ds_config(cfg)["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
        return
    with pytest.raises(UserError, match=r"^config trainer\.deepspeed\.offload_optimizer"):
        ds_config(cfg)


RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "default.yaml"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.deepspeed.zero_stage=5"], r"trainer\.deepspeed\.zero_stage: expected one of"),
    ],
)
def test_bad_deepspeed_config_is_one_line_naming_the_key(overrides, message):
    from treadle.config import load_config

    with pytest.raises(UserError, match=message) as e:
        load_config(RECIPE, overrides)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_deepspeed_on_the_ray_trainer_ranks_loads(mode):
    """The Ray modes' trainer ranks are ZeRO's data-parallel group (tests/cluster/
    test_ray_backends.py trains them)."""
    from treadle.config import load_config

    overrides = ["trainer.backend=deepspeed", f"placement.mode={mode}", "placement.trainers=2"]
    cfg = load_config(RECIPE, overrides)
    assert (cfg.trainer.backend, cfg.placement.trainers) == ("deepspeed", 2)


def test_the_factory_builds_deepspeed_for_a_trainable_model_only(folder, one_torch_thread):
    from treadle.train.backends import build_backend
    from treadle.train.deepspeed_backend import DeepSpeedBackend

    cfg = dataclasses.replace(TRAINER, backend="deepspeed")
    assert type(build_backend(load_model(folder)[0], cfg, 10)) is DeepSpeedBackend
    frozen = build_backend(load_model(folder)[0], cfg, 10, trainable=False)
    assert type(frozen) is TorchBackend and frozen.optimizer is None


def test_a_process_group_started_by_someone_else_is_used(folder, monkeypatch, one_torch_thread):
    """An in-process vLLM engine starts a world-1 group before the trainer when a run resumes
    or skips SFT; DeepSpeed then needs LOCAL_RANK, which only the trainer's own start set."""
    from treadle.train.deepspeed_backend import init_single_process_group

    init_single_process_group()
    monkeypatch.delenv("LOCAL_RANK")
    backend = deepspeed_backend(folder, 2)
    assert torch.isfinite(torch.tensor(float(backend.train_step(batch(), POLICY)["loss"])))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_lora_policy_under_zero_steps_as_under_torch(stage, folder, tmp_path, one_torch_thread):
    """LoRA (model.lora) under ZeRO: the same step as the torch backend's LoRA policy (loss,
    adapter gradients, merged weights for the engine within 1e-5), only the adapters in the
    optimizer, the base weights bit-equal, and the checkpoint the adapter alone (PEFT's)."""
    from safetensors.torch import load_file

    from treadle.config import LoraConfig
    from treadle.train import lora
    from treadle.train.deepspeed_backend import DeepSpeedBackend

    def lora_model():
        torch.manual_seed(0)  # the same fresh adapters (A random, B = 0) in both backends
        return lora.apply_lora(load_model(folder)[0], LoraConfig(r=4))

    base = {n: t.clone() for n, t in load_model(folder)[0].state_dict().items()}
    want = one_step(TorchBackend(lora_model(), TRAINER, 10), batch())
    backend = DeepSpeedBackend(lora_model(), staged(stage), 10, ds_extra=FULL_ZERO3)
    got = one_step(backend, batch())
    assert_same_step(got, want)
    # 2 layers x 7 projections x (A and B): 28 adapter tensors in the optimizer, nothing else
    assert len(got["grads"]) == 28
    assert got["weights"].keys() == base.keys()  # merged, under the base model's names
    state = dict(backend._state())
    frozen = {
        n.replace("base_model.model.", "").replace(".base_layer", ""): t
        for n, t in state.items()
        if "lora_" not in n
    }
    assert all(torch.equal(frozen[n], base[n]) for n in base)  # the base never trains
    moved = [n for n in base if not torch.equal(got["weights"][n], base[n])]
    assert any("q_proj" in n for n in moved) and not any("norm" in n for n in moved)
    backend.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "adapter_model.safetensors")
    assert len(saved) == 28 and all("lora_" in n for n in saved)


def test_the_sft_and_dpo_export_of_zero_3_holds_the_whole_weights(
    folder, tmp_path, one_torch_thread
):
    """What `treadle sft`/`dpo` and the SFT warm-up write (``save_model_atomic`` of
    ``lora.exported(backend)``) under ZeRO-3: the backend's save, the partitions gathered (the
    module's own tensors are 0-element placeholders outside a gather)."""
    from transformers import AutoModelForCausalLM

    from treadle.store.atomic import save_model_atomic
    from treadle.train import lora

    backend = deepspeed_backend(folder, 3)
    one_step(backend, batch())
    assert any(p.numel() == 0 for p in backend.model.parameters())  # partitioned away
    save_model_atomic(lora.exported(backend), load_model(folder)[1], tmp_path / "sft_model")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "sft_model").state_dict()
    weights = dict(backend.named_weights())
    assert all(torch.equal(saved[n], weights[n]) for n in saved)
