"""The TrainingBackend contract, for every implementation: the single-process TorchBackend (as a
policy, a frozen reference and a critic), the megatron-core backend (tensor parallel 1),
the Ray FSDP2 TrainerGroup (2 ranks over gloo; the policy, and a reference and a critic
hosted on the policy's ranks) and DeepSpeed (ZeRO-2 as a policy, ZeRO-3 as a critic, in
this process).

What the loop and the checkpoints rely on: logprobs (and a critic's values) are the model's own,
a step changes the weights and reports typed metrics, the named weights are what
``save_pretrained`` writes, and the optimizer state saved by ``optimizer_state`` resumes a
fresh trainer over the saved weights to the same next step.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from integration.tiny import build_tiny_folder
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from treadle.config import AlgorithmConfig, LoraConfig, TrainerConfig
from treadle.core.metrics import Metric
from treadle.core.protocols import Objective, TrainingBackend
from treadle.core.types import TrainSample
from treadle.store.models import load_critic, load_model
from treadle.train import lora
from treadle.train.objectives import PolicyObjective, ValueObjective
from treadle.train.torch_backend import TorchBackend

TRAINER = TrainerConfig(lr=1e-2, micro_batch_tokens=24, grad_clip=1.0)
POLICY = PolicyObjective.from_config(AlgorithmConfig(), max_tokens=8)


@dataclass
class Impl:
    """How to build one implementation over a model folder, and what it trains with."""

    name: str
    build: object  # (folder) -> TrainingBackend
    objective: Objective | None  # None: frozen (a reference)
    folder: Path
    """The weights it starts from (a policy's, or a critic's with its value head)."""
    head: str = "lm"
    close: object = lambda backend: None


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("backend_contract") / "model"
    build_tiny_folder(path)
    return path


@pytest.fixture(scope="module")
def critic_folder(folder, tmp_path_factory) -> Path:
    """The policy with a (seeded) value head, saved: every load gives the same critic."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("backend_contract") / "critic"
    load_critic(folder).save_pretrained(path)
    return path


GROUPS = ["trainer group", "trainer group critic"]
TRAINABLE = [
    "torch",
    "torch critic",
    "torch lora",
    "megatron",
    *(pytest.param(g, marks=pytest.mark.slow) for g in GROUPS),
    "deepspeed zero-2",
    "deepspeed zero-3 critic",
]
FROZEN = ["torch reference", pytest.param("trainer group reference", marks=pytest.mark.slow)]
EVERY = [*FROZEN, *TRAINABLE]
FULL_WEIGHTS = [i for i in EVERY if i != "torch lora"]
"""Those whose save_pretrained writes the full model (a LoRA backend writes its adapter)."""


@pytest.fixture(scope="module")
def ranks(folder, ray_cluster):
    """``add(role, folder, trainer, trainable, head)``: a model added to the ranks of one 2-rank
    group (started once: a group's start-up is most of its tests' time), each under a role name
    of its own, so every test gets fresh weights and optimizer."""
    from treadle.cluster.placement import place
    from treadle.cluster.trainer_group import TrainerGroup
    from treadle.config import PlacementConfig

    cfg = PlacementConfig(mode="disaggregated", trainers=2, engines=0, threads=1)
    placement = place(cfg)
    group = TrainerGroup(cfg, placement, folder, TRAINER, 10, 1.0)
    names = itertools.count()

    def add(role: str, folder: Path, trainer: TrainerConfig, trainable: bool, head: str):
        return group.add_model(f"{role}{next(names)}", folder, trainer, 10, trainable, head)

    yield add
    group.close()
    placement.remove()


def lora_policy(f: Path) -> TorchBackend:
    """A rank-4 LoRA policy over the model in ``f``, or over the base model the adapter folder
    ``f`` names (a checkpoint's ``model/``) with that adapter."""
    adapter = f if (f / "adapter_config.json").is_file() else None
    base = (
        json.loads((f / "adapter_config.json").read_text())["base_model_name_or_path"]
        if adapter
        else f
    )
    model = lora.apply_lora(load_model(base)[0], LoraConfig(r=4), adapter)
    return TorchBackend(model, TRAINER, 10)


@pytest.fixture
def impl(request, folder) -> Impl:
    if request.param == "torch":
        return Impl("torch", lambda f: TorchBackend(load_model(f)[0], TRAINER, 10), POLICY, folder)
    if request.param == "torch lora":
        return Impl("torch lora", lora_policy, POLICY, folder)
    if request.param == "torch reference":
        frozen = lambda f: TorchBackend(load_model(f)[0], TRAINER, 1, trainable=False)  # noqa: E731
        return Impl("torch reference", frozen, None, folder)
    if request.param == "torch critic":
        critic = lambda f: TorchBackend(load_critic(f), TRAINER, 10, head="value")  # noqa: E731
        value = ValueObjective(value_clip=0.2)
        return Impl(
            "torch critic", critic, value, request.getfixturevalue("critic_folder"), "value"
        )
    if request.param == "megatron":  # tensor parallel 1 in this process (2: tests/train)
        pytest.importorskip("megatron.core", reason="megatron-core is not installed")
        from treadle.train.megatron_backend import MegatronBackend

        cfg = dataclasses.replace(TRAINER, backend="megatron")
        mega = lambda f: MegatronBackend(load_model(f)[0], cfg, 10)  # noqa: E731
        return Impl("megatron", mega, POLICY, folder)
    if request.param.startswith("deepspeed"):
        return deepspeed_impl(request)
    from treadle.cluster.trainer_group import TrainerGroup

    if request.param == "trainer group":
        cfg, placement = request.getfixturevalue("placed")(trainers=2, engines=0)
        group = lambda f: TrainerGroup(cfg, placement, f, TRAINER, 10, 1.0)  # noqa: E731
        return Impl("trainer group", group, POLICY, folder, close=lambda g: g.close())
    add = request.getfixturevalue("ranks")
    if request.param == "trainer group reference":
        frozen = lambda f: add("reference", f, TRAINER, False, "lm")  # noqa: E731
        return Impl(request.param, frozen, None, folder)
    critic = lambda f: add("critic", f, TRAINER, True, "value")  # noqa: E731
    value = ValueObjective(value_clip=0.2)
    return Impl(request.param, critic, value, request.getfixturevalue("critic_folder"), "value")


def deepspeed_impl(request) -> Impl:
    """DeepSpeed ZeRO-2 as a policy, ZeRO-3 (every tensor partitioned) as a critic, world 1."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/install.sh)")
    from treadle.config import DeepSpeedConfig
    from treadle.train.deepspeed_backend import DeepSpeedBackend

    stage = 3 if "zero-3" in request.param else 2
    cfg = replace(TRAINER, deepspeed=DeepSpeedConfig(zero_stage=stage))
    extra = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    if "critic" in request.param:
        critic = lambda f: DeepSpeedBackend(load_critic(f), cfg, 10, head="value", ds_extra=extra)  # noqa: E731
        value = ValueObjective(value_clip=0.2)
        folder = request.getfixturevalue("critic_folder")
        return Impl(request.param, critic, value, folder, "value")
    policy = lambda f: DeepSpeedBackend(load_model(f)[0], cfg, 10, ds_extra=extra)  # noqa: E731
    return Impl(request.param, policy, POLICY, request.getfixturevalue("folder"))


def batch(n: int = 6) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        p, c = 3 + i % 3, 2 + i % 4
        ids = torch.randint(3, 250, (p + c,), generator=gen).tolist()
        logprobs = (-torch.rand(c, generator=gen) - 1).tolist()
        out.append(
            TrainSample(
                token_ids=ids,
                loss_mask=[False] * p + [True] * c,
                behavior_logprobs=[0.0] * p + logprobs,
                advantages=[0.0] * p + [1.0 if i % 2 else -1.0] * c,
                policy_version=0,
                group_id=f"g{i // 2}",
                values=torch.randn(p + c, generator=gen).tolist(),
                returns=torch.randn(p + c, generator=gen).tolist(),
            )
        )
    return out


def reference_outputs(folder: Path, head: str, samples: list[TrainSample]) -> list[list[float]]:
    """What the Hugging Face model itself computes: each token's logprob given the tokens
    before it, or (a critic) the value at the token before; index 0 is 0.0."""
    if head == "value":
        model = load_critic(folder)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for s in samples:
            x = torch.tensor([s.token_ids])
            logits = model(input_ids=x).logits[0, :-1]
            if head == "value":
                got = logits[:, 0]
            else:
                got = F.log_softmax(logits, -1).gather(1, x[0, 1:, None])[:, 0]
            out.append([0.0, *got.tolist()])
    return out


def outputs(backend: TrainingBackend, head: str, samples) -> list[list[float]]:
    if head == "value":
        return backend.compute_values(samples)
    return backend.compute_logprobs(samples)


def max_diff(a, b) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


@pytest.mark.parametrize("impl", EVERY, indirect=True)
def test_outputs_are_the_models_own(impl, one_torch_thread):
    backend = impl.build(impl.folder)
    try:
        samples = batch()
        got = outputs(backend, impl.head, samples)
        assert all(row[0] == 0.0 for row in got)
        assert max_diff(got, reference_outputs(impl.folder, impl.head, samples)) < 1e-5
    finally:
        impl.close(backend)


@pytest.mark.parametrize("impl", FROZEN, indirect=True)
def test_a_frozen_reference_neither_trains_nor_has_optimizer_state(impl):
    backend = impl.build(impl.folder)
    try:
        with pytest.raises(AssertionError, match="frozen"):
            backend.train_step(batch(), POLICY)
        with pytest.raises(RuntimeError, match="frozen"):
            backend.optimizer_state()
    finally:
        impl.close(backend)


@pytest.mark.parametrize("impl", TRAINABLE, indirect=True)
def test_a_step_changes_the_weights_and_reports_typed_metrics(impl, one_torch_thread):
    backend = impl.build(impl.folder)
    try:
        before = {name: t.clone() for name, t in backend.named_weights()}
        metrics = backend.train_step(batch(), impl.objective)
        for name in ("loss", "grad_norm", "lr", "perf/tokens"):
            assert isinstance(metrics[name], Metric), name
            assert torch.isfinite(torch.tensor(float(metrics[name]))), name
        after = dict(backend.named_weights())
        assert after.keys() == before.keys()
        changed = [n for n in after if not torch.equal(after[n], before[n])]
        assert len(changed) >= len(after) // 2, changed  # not just one tensor
    finally:
        impl.close(backend)


@pytest.mark.parametrize("impl", FULL_WEIGHTS, indirect=True)
def test_named_weights_are_what_save_pretrained_writes(impl, tmp_path, one_torch_thread):
    backend = impl.build(impl.folder)
    try:
        named = dict(backend.named_weights())
        backend.save_pretrained(tmp_path / "saved")
    finally:
        impl.close(backend)
    loader = AutoModelForTokenClassification if impl.head == "value" else AutoModelForCausalLM
    saved = loader.from_pretrained(tmp_path / "saved", dtype=torch.float32).state_dict()
    assert saved.keys() == named.keys()
    assert all(torch.equal(saved[n], named[n]) for n in named)


@pytest.mark.parametrize("impl", TRAINABLE, indirect=True)
def test_saved_weights_and_optimizer_state_resume_to_the_same_next_step(
    impl, folder, tmp_path, one_torch_thread
):
    samples, probe = batch(), batch(4)
    backend = impl.build(impl.folder)
    try:
        backend.train_step(samples, impl.objective)  # the moments are no longer zero
        backend.save_pretrained(tmp_path / "ckpt")
        load_model(folder)[1].save_pretrained(tmp_path / "ckpt")  # as a checkpoint holds it
        state = copy.deepcopy(backend.optimizer_state())  # it may share the live tensors
        backend.train_step(samples, impl.objective)
        expected = outputs(backend, impl.head, probe)
    finally:
        impl.close(backend)
    resumed = impl.build(tmp_path / "ckpt")
    try:
        resumed.load_optimizer_state(state)
        resumed.train_step(samples, impl.objective)
        assert max_diff(outputs(resumed, impl.head, probe), expected) < 1e-6
    finally:
        impl.close(resumed)


@pytest.mark.slow
@pytest.mark.parametrize("option", ["gradient_checkpointing", "bf16_autocast"])
def test_trainer_group_options_step_as_one_process(option, folder, ranks, one_torch_thread):
    """A policy on the 2 FSDP2 ranks with gradient checkpointing (fp32) or bf16 autocast gives
    the single-process backend's losses with the same option; its master weights stay fp32."""
    trainer = dataclasses.replace(TRAINER, **{option: True})
    group = ranks("policy", folder, trainer, True, "lm")
    single = TorchBackend(load_model(folder)[0], trainer, 10)
    fp32 = TorchBackend(load_model(folder)[0], TRAINER, 10)  # neither option
    logprobs = [b.compute_logprobs(batch()) for b in (group, single, fp32)]  # before any step
    losses = [
        [float(b.train_step(batch(), POLICY)["loss"]) for _ in range(2)]
        for b in (group, single, fp32)
    ]
    state = group.optimizer_state().optimizer["state"]
    (g0, g1), (s0, s1), (f0, _) = losses
    if option == "gradient_checkpointing":
        # The same fp32 math as without it: the group's packing and reduction order only
        # (~1e-7), and the step between moves the loss by far more than that.
        assert g0 == pytest.approx(s0, abs=1e-6) == pytest.approx(f0, abs=1e-6)
        assert g1 == pytest.approx(s1, abs=1e-5) and abs(s1 - s0) > 1e-3
    else:
        # bf16 rounds each matmul's inputs and output to 8 significant bits (unit roundoff
        # u = 2^-9); the group runs the same casts on other packings of the rows, whose fp32
        # accumulation order differs, so its losses and logprobs may differ from one
        # process's by a few roundings (bound: 4u of their size).
        u = 2.0**-9
        assert abs(g0 - s0) <= 4 * u * abs(s0) and abs(g1 - s1) <= 4 * u * abs(s1)
        (group_lp, single_lp, fp32_lp) = logprobs
        largest = max(abs(x) for row in single_lp for x in row)  # about 5.7 nats
        assert max_diff(group_lp, single_lp) <= 4 * u * largest
        # Both compute in bf16: their logprobs move from fp32's by far more than fp32's own
        # reordering does (1e-6, above), 2.5e-3 nats on a 2-core EPYC. The first loss cannot
        # tell: its clipped terms are constants and the others ratios near exp(-4), so bf16
        # moved it by 4e-7 there, less than the group's packing did (6.3e-7).
        assert max_diff(group_lp, fp32_lp) > 1e-4 and max_diff(single_lp, fp32_lp) > 1e-4
    moments = [t for v in state.values() for t in v.values() if torch.is_tensor(t) and t.ndim]
    assert moments and all(t.dtype == torch.float32 for t in moments)  # Adam's, as its weights


@pytest.mark.parametrize("impl", ["torch lora"], indirect=True)
def test_a_lora_backend_saves_its_adapter_and_syncs_merged_weights(impl, tmp_path):
    """What a LoRA checkpoint holds: the adapter tensors only (PEFT's file), naming the base;
    named_weights are the base model's names (merged), no lora_ tensors."""
    backend = impl.build(impl.folder)
    backend.train_step(batch(), impl.objective)
    backend.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "adapter_model.safetensors")
    expected = dict(lora.adapter_weights(backend.model.state_dict()))
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[n], expected[n]) for n in saved)
    base = AutoModelForCausalLM.from_pretrained(impl.folder, dtype=torch.float32).state_dict()
    assert dict(backend.named_weights()).keys() == base.keys()
