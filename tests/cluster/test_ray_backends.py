"""The Ray trainer group hosting the other backends' ranks on this CPU: 2 DeepSpeed ZeRO ranks
(data parallel, each a share of the samples) and 2 megatron-core ranks (one tensor-parallel
group, each all the samples), each against a single-process torch backend on the same batch,
and a vLLM engine worker synced from each group. (FSDP2's group: tests/cluster/test_ray.py.)"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from treadle.config import PlacementConfig
from treadle.config.sections import DeepSpeedConfig, MegatronConfig
from treadle.core.protocols import EngineSpec, SamplingParams
from treadle.store.models import load_model
from treadle.train.torch_backend import TorchBackend

from .test_ray import OBJECTIVE, TRAINER, max_diff, samples_from, tiny_model_folder

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(
            importlib.util.find_spec(m) is None
            for m in ("ray", "vllm", "deepspeed", "megatron.core")
        ),
        reason="needs ray, vllm, deepspeed and megatron-core (scripts/install.sh installs them)",
    ),
]

BACKENDS = {
    "zero2": dataclasses.replace(TRAINER, backend="deepspeed", deepspeed=DeepSpeedConfig(2)),
    "zero3": dataclasses.replace(TRAINER, backend="deepspeed", deepspeed=DeepSpeedConfig(3)),
    "megatron_tp2": dataclasses.replace(
        TRAINER, backend="megatron", megatron=MegatronConfig(tensor_parallel=2)
    ),
}
PLACEMENT = PlacementConfig(mode="disaggregated", trainers=2, engines=1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray

    from treadle.cluster.engine_group import EngineGroup
    from treadle.cluster.placement import place

    # 2 KV heads: tensor parallel 2 splits them
    folder, tokenizer = tiny_model_folder(tmp_path_factory.mktemp("ray_backends") / "model", 2)
    placement = place(PLACEMENT)
    engines = EngineGroup("vllm", EngineSpec(str(folder), max_model_len=256), placement, 1)
    prompts = [tokenizer.encode(f"{a} + {b} =") for a in range(4) for b in range(4)]
    samples = samples_from(prompts, engines.generate(prompts, SamplingParams(n=4, max_tokens=8)))
    yield folder, placement, engines, samples
    engines.close()
    placement.remove()
    ray.shutdown()


@pytest.mark.parametrize("name", list(BACKENDS))
def test_a_group_of_backend_ranks_trains_as_one_process(name, cluster, tmp_path, one_torch_thread):
    from treadle.cluster.trainer_group import TrainerGroup
    from treadle.cluster.transports import RaySync

    folder, placement, engines, samples = cluster
    single = TorchBackend(load_model(folder, "float32")[0], TRAINER, 20, 1.0)

    group = TrainerGroup(PLACEMENT, placement, folder, BACKENDS[name], 20, 1.0)
    try:
        # the frozen KL reference on the same ranks (megatron: the TP group; ZeRO: a plain
        # copy per rank) scores as the untrained policy, before and after the policy trains
        reference = group.add_model("reference", folder, BACKENDS[name], 1, False, "lm")
        initial = single.compute_logprobs(samples)
        assert max_diff(reference.compute_logprobs(samples), initial) < 1e-5
        for step in range(2):
            a, b = single.train_step(samples, OBJECTIVE), group.train_step(samples, OBJECTIVE)
            # one step-wide loss whatever the split (ZeRO: each rank's share, scaled by the
            # world; TP: one loss over both ranks): fp32 reduction orders differ by ~1e-7
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), step
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), step
            assert b["perf/tokens"] == a["perf/tokens"]
        # The ranks' optimizer state goes out whole and back into their partitions: the third
        # step is still the single process's.
        group.load_optimizer_state(group.optimizer_state())
        a, b = single.train_step(samples, OBJECTIVE), group.train_step(samples, OBJECTIVE)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        # 1e-4: Adam moves a weight whose gradient is ~0 by ~lr whatever its sign, so the other
        # reduction order (~1e-7 in a gradient) reaches ~1e-5 in weights and 3e-5 in these
        # logprobs after 2 steps; a wrong shard or a lost moment moves them by ~0.2.
        assert max_diff(group.compute_logprobs(samples), single.compute_logprobs(samples)) < 1e-4
        group.save_pretrained(tmp_path / "group")
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / "group", dtype=torch.float32)
        ours = dict(single.model.named_parameters())
        diffs = [(ours[n] - p).abs().max().item() for n, p in saved.named_parameters()]
        # 5e-5: as tests/cluster/test_ray.py's FSDP2 bound (3 Adam steps move a weight ~3e-3)
        assert len(diffs) == len(ours) and max(diffs) <= 5e-5
        assert max_diff(reference.compute_logprobs(samples), initial) < 1e-5
        # A sync of rank 0's gathered weights by each transport, after a step of its own:
        # the engine scores as the group.
        for transport in ("shared_memory", "collective"):
            group.train_step(samples, OBJECTIVE)
            sync = RaySync(transport, group, engines, "float32", bucket_mb=1)
            sync.sync(engines.policy_version + 1)
            served = engines.prompt_logprobs([s.token_ids for s in samples[:8]])
            assert max_diff(served, group.compute_logprobs(samples[:8])) < 1e-4, transport
    finally:
        group.close()


def test_a_backend_refusal_on_the_ranks_is_one_line(cluster, one_torch_thread):
    """A config the backend refuses on a rank (megatron-core autocasts for CUDA only) reaches
    the driver as the rank's one-line UserError, not as a Ray traceback."""
    from treadle.cluster.trainer_group import TrainerGroup
    from treadle.core.errors import UserError

    if torch.cuda.is_available():
        pytest.skip("megatron-core autocasts bf16 on CUDA: nothing to refuse")
    folder, placement, _, _ = cluster
    bf16 = dataclasses.replace(BACKENDS["megatron_tp2"], bf16_autocast=True)
    with pytest.raises(UserError, match=r"^config trainer\.bf16_autocast=true with .*=false$") as e:
        TrainerGroup(PLACEMENT, placement, folder, bf16, 20, 1.0)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)
