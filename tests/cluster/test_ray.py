"""The Ray roles on this CPU: a 2-rank FSDP2 trainer group over gloo and a vLLM engine worker:
parity with single-process training, a skipped sync caught, and an engine worker killed while it
generates or before a sync. (Every transport's contract: tests/contracts/test_weight_sync.py.)"""

from __future__ import annotations

import importlib.util
import os
import signal
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from treadle.config import AlgorithmConfig, PlacementConfig, TinyModelConfig, TrainerConfig
from treadle.core.protocols import EngineSpec, SamplingParams
from treadle.core.types import Task, TrainSample
from treadle.rollout.generate import Generated, check_policy_version
from treadle.store.atomic import save_model_atomic
from treadle.store.models import build_tiny_model, build_tokenizer, load_model
from treadle.train.objectives import PolicyObjective
from treadle.train.torch_backend import TorchBackend

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None or importlib.util.find_spec("vllm") is None,
        reason="needs ray and vllm (scripts/install.sh installs both)",
    ),
]

TRAINER = TrainerConfig(lr=1e-3, micro_batch_tokens=96, grad_clip=1.0)
OBJECTIVE = PolicyObjective.from_config(AlgorithmConfig(), 8)


def tiny_model_folder(folder, kv_heads: int = 1):
    """A tiny Qwen2 policy (2 layers, 64 wide, 2 query heads over ``kv_heads``) of an addition
    tokenizer saved in ``folder``: ``(folder, tokenizer)``."""
    tokenizer = build_tokenizer([f"{a} + {b} = {a + b}" for a in range(30) for b in range(30)], 300)
    tiny = TinyModelConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
    )
    save_model_atomic(build_tiny_model(tiny, tokenizer, seed=0), tokenizer, folder)
    return folder, tokenizer


@pytest.fixture(scope="module")
def roles(tmp_path_factory):
    import ray

    from treadle.cluster import close_ray_roles
    from treadle.cluster.engine_group import EngineGroup
    from treadle.cluster.placement import place
    from treadle.cluster.trainer_group import TrainerGroup

    folder, tokenizer = tiny_model_folder(tmp_path_factory.mktemp("ray") / "model")
    cfg = PlacementConfig(mode="disaggregated", trainers=2, engines=1)
    placement = place(cfg)
    trainers = TrainerGroup(cfg, placement, folder, TRAINER, 20, 1.0)
    engines = EngineGroup(
        "vllm", EngineSpec(str(folder), max_model_len=256), placement, 1, trainers=trainers
    )
    prompts = [tokenizer.encode(f"{a} + {b} =") for a in range(4) for b in range(4)]
    yield folder, trainers, engines, prompts
    close_ray_roles(trainers, engines)
    ray.shutdown()


def samples_from(prompts, completions) -> list[TrainSample]:
    """Train samples with a reward of +1 for an even first token, -1 otherwise (any signal that
    moves the weights)."""
    out = []
    for p, group in zip(prompts, completions, strict=True):
        for c in group:
            n, adv = len(c.token_ids), 1.0 if c.token_ids[0] % 2 == 0 else -1.0
            out.append(
                TrainSample(
                    token_ids=[*p, *c.token_ids],
                    loss_mask=[False] * len(p) + [True] * n,
                    behavior_logprobs=[0.0] * len(p) + list(c.logprobs),
                    advantages=[0.0] * len(p) + [adv] * n,
                    policy_version=c.policy_version,
                    group_id=str(p),
                )
            )
    return out


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def test_fsdp_group_matches_single_process_training(roles, tmp_path, one_torch_thread):
    folder, trainers, engines, prompts = roles
    params = SamplingParams(n=4, max_tokens=8, seed=0)
    samples = samples_from(prompts, engines.generate(prompts, params))  # the same data for both
    single = TorchBackend(load_model(folder, "float32")[0], TRAINER, 20, 1.0)
    for step in range(3):
        a = single.train_step(samples, OBJECTIVE)
        b = trainers.train_step(samples, OBJECTIVE)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), step
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), step
        assert b["perf/tokens"] == a["perf/tokens"]
    trainers.save_pretrained(tmp_path / "group")
    group = AutoModelForCausalLM.from_pretrained(tmp_path / "group", dtype=torch.float32)
    ours = dict(single.model.named_parameters())
    diffs = [(ours[n] - p).abs().max().item() for n, p in group.named_parameters()]
    # Adam moves each weight by about lr = 1e-3 per step (3e-3 in 3 steps) whatever its gradient's
    # size, so a weight whose gradient is near 0 turns the group's other reduction order (~1e-7 in
    # the gradient) into ~1e-5 in the weight: 1.9e-5 on the seeded samples of this data, <2% of
    # the 3e-3 moved. 5e-5 bounds that; a wrong shard or a missed step moves weights by ~1e-3.
    assert len(diffs) == len(ours) and max(diffs) <= 5e-5
    # The trainer group's logprobs are the single process's too.
    assert (
        max_diff(trainers.compute_logprobs(samples[:8]), single.compute_logprobs(samples[:8]))
        < 1e-5
    )


def test_a_skipped_sync_is_detected(roles, one_torch_thread):
    from treadle.core.errors import StaleWeightsError

    _, trainers, engines, prompts = roles
    samples = samples_from(prompts, engines.generate(prompts, SamplingParams(n=2, max_tokens=8)))
    trainers.train_step(samples, OBJECTIVE)  # the trainer steps ...
    trainer_version = engines.policy_version + 1  # ... and its sync is skipped on purpose
    out = engines.generate(prompts[:2], SamplingParams(n=2, max_tokens=4))
    # The engine would silently sample from the old weights ...
    assert max_diff(engines.prompt_logprobs([s.token_ids for s in samples[:4]]),
                    trainers.compute_logprobs(samples[:4])) > 1e-3  # fmt: skip
    generated = [Generated(Task(f"t{i}", (), "", "d"), tuple(p), tuple(g))
                 for i, (p, g) in enumerate(zip(prompts[:2], out, strict=True))]  # fmt: skip
    # ... and the loop's check refuses its completions.
    with pytest.raises(StaleWeightsError, match=f"trainer is at version {trainer_version}"):
        check_policy_version(generated, trainer_version)


def test_a_killed_engine_worker_is_replaced_and_its_requests_retried(roles, one_torch_thread):
    from treadle.cluster.transports import RaySync

    _, trainers, engines, prompts = roles
    sync = RaySync("shared_memory", trainers, engines, "float32", bucket_mb=1)
    sync.sync(engines.policy_version + 1)
    (pid,) = engines.pids()
    many = prompts * 8  # 128 prompts x 8 samples x 48 tokens: seconds of generation
    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
    killer.start()
    out = engines.generate(many, SamplingParams(n=8, max_tokens=48, seed=1))
    killer.join()
    assert engines.restarts == 1 and engines.pids() != [pid]
    assert len(out) == len(many) and all(len(g) == 8 for g in out)
    assert {c.policy_version for g in out for c in g} == {engines.policy_version}
    # The new worker serves the current weights, not the ones it started from.
    samples = samples_from(prompts[:3], engines.generate(prompts[:3], SamplingParams(n=1)))
    assert max_diff(engines.prompt_logprobs([s.token_ids for s in samples]),
                    trainers.compute_logprobs(samples)) < 1e-4  # fmt: skip
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("transport", ["collective", "shared_memory"])
def test_an_engine_killed_before_a_sync_is_replaced_and_the_sync_completes(
    transport, roles, one_torch_thread
):
    from treadle.cluster.transports import RaySync

    _, trainers, engines, prompts = roles
    sync = RaySync(transport, trainers, engines, "float32", bucket_mb=1)
    sync.sync(engines.policy_version + 1)  # the collective group is up; the file is mapped
    samples = samples_from(prompts, engines.generate(prompts, SamplingParams(n=2, max_tokens=8)))
    trainers.train_step(samples, OBJECTIVE)
    restarts = engines.restarts
    (pid,) = engines.pids()
    os.kill(pid, signal.SIGKILL)  # dies between the update and the sync
    version = engines.policy_version + 1
    sync.sync(version)  # sends or loads fail, the worker is replaced, the sync is redone
    assert engines.restarts == restarts + 1 and engines.pids() != [pid]
    assert engines.policy_version == version
    assert max_diff(engines.prompt_logprobs([s.token_ids for s in samples[:4]]),
                    trainers.compute_logprobs(samples[:4])) < 1e-4  # fmt: skip
    assert trainers.compute_logprobs([]) == []
