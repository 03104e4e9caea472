"""The Objective contract, for every objective: the policy objectives (each loss, aggregation,
KL term, importance-sampling correction, entropy bonus), the critic's, SFT's and the fake.

An objective returns one micro-batch's share of the step's loss, with step-wide denominators:
so however the step's samples are packed into micro-batches, the shares add up to the loss of
the whole step computed at once, and its metrics are typed (each a Metric with a reduction).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from contracts.fakes import AdvantageAsLoss
from treadle.config import AlgorithmConfig, KLConfig, TrainerConfig
from treadle.core.batch import StepTotals
from treadle.core.metrics import Metric
from treadle.core.protocols import Objective
from treadle.core.types import TrainSample
from treadle.train.objectives import PolicyObjective, SFTObjective, ValueObjective
from treadle.train.packing import pack
from treadle.train.torch_backend import TorchBackend


def policy(**algorithm) -> PolicyObjective:
    return PolicyObjective.from_config(AlgorithmConfig(**algorithm), max_tokens=8)


OBJECTIVES: dict[str, Objective] = {
    "ppo token-mean": policy(),
    "ppo clip-higher dual-clip seq-mean-token-sum": policy(
        clip_eps_high=0.28, dual_clip=3.0, loss_agg="seq-mean-token-sum"
    ),
    "gspo seq-mean-token-mean": policy(policy_loss="gspo", loss_agg="seq-mean-token-mean"),
    "vanilla seq-mean-token-sum-norm": policy(
        policy_loss="vanilla", loss_agg="seq-mean-token-sum-norm"
    ),
    "ppo + k3 KL + entropy bonus": policy(kl=KLConfig(coef=0.1), entropy_coef=0.01),
    "ppo + tis_token": policy(importance_sampling="tis_token"),
    "ppo + mis_seq": policy(importance_sampling="mis_seq"),
    "ppo + decoupled": policy(importance_sampling="decoupled"),
    "value": ValueObjective(value_clip=0.2),
    "sft": SFTObjective(),
    "fake: advantage as loss": AdvantageAsLoss(),
}


def samples() -> list[TrainSample]:
    """Three samples of different lengths with every per-token field an objective may read."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for p, n in ((3, 4), (2, 6), (4, 2)):
        length = p + n

        def noise(length: int = length) -> list[float]:
            return (-torch.rand(length, generator=gen)).tolist()

        out.append(
            TrainSample(
                token_ids=torch.randint(1, 60, (length,), generator=gen).tolist(),
                loss_mask=[False] * p + [True] * n,
                behavior_logprobs=[0.0] * p + noise()[p:],
                advantages=[0.0] * p + torch.randn(n, generator=gen).tolist(),
                policy_version=0,
                group_id=f"g{p}",
                ref_logprobs=noise(),
                old_logprobs=noise(),
                values=torch.randn(length, generator=gen).tolist(),
                returns=torch.randn(length, generator=gen).tolist(),
            )
        )
    return out


def shares(backend: TorchBackend, objective: Objective, batch, groups: list[list[int]]):
    """The step's loss (the sum of the micro-batches' shares) and the shares' metrics."""
    totals = StepTotals(
        tokens=sum(sum(s.loss_mask) for s in batch), sequences=sum(any(s.loss_mask) for s in batch)
    )
    total, metrics = torch.zeros(()), []
    for index in groups:
        mb = pack(batch, index)
        out = backend.forward(mb, objective.entropy_grad)
        loss, m = objective(out, mb, totals)
        assert loss.shape == () and loss.requires_grad
        total = total + loss.detach()
        metrics.append(m)
    return float(total), metrics


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_shares_add_up_to_the_step_loss_however_the_step_is_packed(
    name, tiny_qwen2, tiny_value_model
):
    objective = OBJECTIVES[name]
    assert isinstance(objective.entropy_grad, bool) and isinstance(objective.engine_sampled, bool)
    head = "value" if isinstance(objective, ValueObjective) else "lm"
    model = tiny_value_model if head == "value" else tiny_qwen2(0)
    backend = TorchBackend(model, TrainerConfig(), total_steps=1, head=head)
    batch = samples()
    whole, _ = shares(backend, objective, batch, [[0, 1, 2]])
    split, metrics = shares(backend, objective, batch, [[0], [1, 2]])
    apart, _ = shares(backend, objective, batch, [[2], [0], [1]])
    assert torch.isfinite(torch.tensor(whole))
    assert split == pytest.approx(whole, abs=1e-6) and apart == pytest.approx(whole, abs=1e-6)
    for m in metrics:  # typed: the backend reduces them by their declared reduction
        assert all(isinstance(v, Metric) for v in m.values()), m


def test_a_policy_objective_refuses_a_batch_without_what_it_needs(tiny_qwen2):
    backend = TorchBackend(tiny_qwen2(0), TrainerConfig(), total_steps=1)
    bare = [dataclasses.replace(s, ref_logprobs=[], old_logprobs=[]) for s in samples()]
    totals = StepTotals(tokens=12, sequences=3)
    mb = pack(bare, [0, 1, 2])
    out = backend.forward(mb)
    with pytest.raises(ValueError, match="reference logprobs"):
        OBJECTIVES["ppo + k3 KL + entropy bonus"](out, mb, totals)
    with pytest.raises(ValueError, match="old logprobs"):
        OBJECTIVES["ppo + tis_token"](out, mb, totals)
