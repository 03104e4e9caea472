"""The WeightSync contract, for every transport: in one process (into the fake, the transformers
and the vLLM engine) and the Ray transports from a 2-rank FSDP2 trainer group to a vLLM engine
worker (shared memory, collective, disk).

After a real optimizer step, ``sync(version)`` makes the engine serve the trainer's weights as
that version (its logprobs are the trainer's; its completions carry the version) and reports
what it moved; an engine left at another version is refused, never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from integration.tiny import build_tiny_folder, max_abs_diff, prompt_ids, skip_without_vllm

from contracts.fakes import FakeEngine
from treadle.config import AlgorithmConfig, TrainerConfig
from treadle.core.errors import StaleWeightsError
from treadle.core.protocols import EngineSpec, InferenceEngine, SamplingParams, WeightSync
from treadle.core.types import TrainSample
from treadle.rollout.engines import build_engine
from treadle.store.models import load_model
from treadle.train.objectives import PolicyObjective
from treadle.train.torch_backend import TorchBackend
from treadle.train.weight_sync import InProcessSync

TRAINER = TrainerConfig(lr=1e-2, micro_batch_tokens=96, grad_clip=1.0)
POLICY = PolicyObjective.from_config(AlgorithmConfig(), max_tokens=8)
TRANSPORTS = [
    "in process: fake",
    "in process: hf",
    pytest.param("in process: vllm", marks=pytest.mark.slow),
    pytest.param("ray: shared_memory", marks=pytest.mark.slow),
    pytest.param("ray: collective", marks=pytest.mark.slow),
    pytest.param("ray: disk", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("sync_contract") / "model"
    build_tiny_folder(path)
    return path


@pytest.fixture(scope="module")
def ray_roles(folder, ray_cluster):
    """A 2-rank trainer group and one vLLM engine worker over ``folder``."""
    skip_without_vllm()
    from treadle.cluster import close_ray_roles
    from treadle.cluster.engine_group import EngineGroup
    from treadle.cluster.placement import place
    from treadle.cluster.trainer_group import TrainerGroup
    from treadle.config import PlacementConfig

    cfg = PlacementConfig(mode="disaggregated", trainers=2, engines=1, threads=1)
    placement = place(cfg)
    trainers = TrainerGroup(cfg, placement, folder, TRAINER, 20, 1.0)
    spec = EngineSpec(str(folder), max_model_len=256)
    engines = EngineGroup("vllm", spec, placement, 1, trainers=trainers)
    yield trainers, engines
    close_ray_roles(trainers, engines)


@dataclass
class Setup:
    """One transport and the two ends it joins."""

    sync: WeightSync
    policy: object  # TrainingBackend
    engine: InferenceEngine


@pytest.fixture(params=TRANSPORTS)
def setup(request, folder, tmp_path, one_torch_thread):
    kind, _, name = request.param.partition(": ")
    if kind == "ray":
        from treadle.cluster.transports import RaySync

        trainers, engines = request.getfixturevalue("ray_roles")
        sync = RaySync(name, trainers, engines, "float32", bucket_mb=1, disk_dir=tmp_path)
        yield Setup(sync, trainers, engines)
        return
    policy = TorchBackend(load_model(folder)[0], TRAINER, 20)
    if name == "fake":
        engine = FakeEngine(load_model(folder)[1])
    else:
        if name == "vllm":
            skip_without_vllm()
        engine = build_engine(name, EngineSpec(str(folder), seed=0))
    yield Setup(InProcessSync(policy, engine), policy, engine)
    engine.close()


def samples(tokenizer_prompts: list[list[int]]) -> list[TrainSample]:
    """Fixed replies to the prompts with advantages +-1: any signal that moves the weights."""
    out = []
    for i, p in enumerate(tokenizer_prompts):
        reply = [(7 * i + j) % 200 + 20 for j in range(5)]
        out.append(
            TrainSample(
                token_ids=p + reply,
                loss_mask=[False] * len(p) + [True] * len(reply),
                behavior_logprobs=[0.0] * len(p) + [-3.0] * len(reply),
                advantages=[0.0] * len(p) + [1.0 if i % 2 else -1.0] * len(reply),
                policy_version=0,
                group_id=str(i),
            )
        )
    return out


def test_a_sync_makes_the_engine_serve_the_trainer_weights_as_that_version(setup, folder):
    tokenizer = load_model(folder)[1]
    prompts = [prompt_ids(tokenizer, f"What is {a} + 1?") for a in range(6)]
    batch = samples(prompts)
    setup.policy.train_step(batch, POLICY)  # weights the engine has not seen
    version = setup.engine.policy_version + 1
    report = setup.sync.sync(version)
    size = sum(t.numel() * t.element_size() for _, t in setup.policy.named_weights())
    assert report["sync/bytes"] == size and report["sync/seconds"] > 0
    assert report["sync/gb_per_s"] == pytest.approx(size / report["sync/seconds"] / 1e9)
    assert setup.engine.policy_version == version
    out = setup.engine.generate(prompts[:2], SamplingParams(n=2, max_tokens=4, seed=0))
    assert {c.policy_version for g in out for c in g} == {version}
    if isinstance(setup.engine, FakeEngine):  # no model: it holds exactly the trainer's tensors
        held = setup.engine.weights
        assert all(torch.equal(held[n], t) for n, t in setup.policy.named_weights())
        return
    served = setup.engine.prompt_logprobs([s.token_ids for s in batch])
    assert max_abs_diff(served, setup.policy.compute_logprobs(batch)) < 1e-4


class DeafEngine(FakeEngine):
    """Takes the weights but keeps serving its old version (a sync that did not land)."""

    def update_weights(self, weights, version: int) -> None:
        super().update_weights(weights, self.policy_version)


def test_an_engine_left_at_another_version_is_refused(folder):
    model, tokenizer = load_model(folder)
    sync = InProcessSync(TorchBackend(model, TRAINER, 20), DeafEngine(tokenizer))
    with pytest.raises(StaleWeightsError, match="after a sync to 1"):
        sync.sync(1)
