"""Tests for treadle.train.torch_backend on a tiny fp32 Qwen2: logprobs, loss aggregation over
packed micro-batches, gradients, metrics and the LR schedule."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from contracts.fakes import AdvantageAsLoss

from treadle.algorithms.losses import PolicyLossParams, ppo_clip
from treadle.config import AlgorithmConfig, TrainerConfig
from treadle.core.types import TrainSample
from treadle.train.objectives import PolicyObjective, SFTObjective
from treadle.train.torch_backend import TorchBackend, lr_lambda

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NO_CLIP = 1e6  # grad_clip so large that clipping never rescales the gradient
PPO = PolicyObjective.from_config(AlgorithmConfig(), max_tokens=32)  # token-mean PPO clip


def sample(
    prompt: list[int],
    completion: list[int],
    advantage: float = 0.0,
    behavior: list[float] | None = None,
) -> TrainSample:
    p, n = len(prompt), len(completion)
    return TrainSample(
        token_ids=prompt + completion,
        loss_mask=[False] * p + [True] * n,
        behavior_logprobs=[0.0] * p + (behavior if behavior is not None else [0.0] * n),
        advantages=[0.0] * p + [advantage] * n,
        policy_version=0,
        group_id="g",
    )


def backend(model, **cfg) -> TorchBackend:
    return TorchBackend(model, TrainerConfig(**cfg), total_steps=10)


def manual_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """``[L]``: log_softmax(logits[t - 1] / T)[ids[t]] for t >= 1, and 0.0 at t = 0."""
    x = torch.tensor([ids])
    logits = model(input_ids=x, use_cache=False).logits[0, :-1] / temperature
    lp = F.log_softmax(logits, dim=-1).gather(1, x[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


@torch.no_grad()
def test_compute_logprobs_matches_manual_log_softmax(tiny_qwen2):
    model = tiny_qwen2(0)
    samples = [sample([1, 2, 3], [4, 5]), sample([6], [7, 8, 9, 10, 11]), sample([12, 13], [14])]
    cfg = TrainerConfig(micro_batch_tokens=64)
    b = TorchBackend(model, cfg, total_steps=1, temperature=0.7, trainable=False)
    out = b.compute_logprobs(samples)  # all three packed in one micro-batch (13 <= 64 tokens)
    for s, lp in zip(samples, out, strict=True):
        assert len(lp) == len(s)
        assert lp[0] == 0.0  # no context: defined as 0
        expected = manual_logprobs(model, s.token_ids, temperature=0.7)
        torch.testing.assert_close(torch.tensor(lp), expected, atol=1e-5, rtol=0)
    # The temperature is applied: at T = 1 the values are different.
    plain = manual_logprobs(model, samples[0].token_ids)
    assert (torch.tensor(out[0]) - plain).abs().max() > 1e-3


@torch.no_grad()
def test_compute_logprobs_is_independent_of_the_micro_batch_budget(tiny_qwen2):
    model = tiny_qwen2(0)
    samples = [sample(list(range(1, 9)), [9, 10]), sample(list(range(20, 26)), [30] * 6)]
    one = backend(model, micro_batch_tokens=4096).compute_logprobs(samples)
    split = backend(model, micro_batch_tokens=16).compute_logprobs(samples)  # 10 + 12 > 16
    torch.testing.assert_close(torch.tensor(one[0]), torch.tensor(split[0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(one[1]), torch.tensor(split[1]), atol=1e-5, rtol=0)


advantage_as_loss = AdvantageAsLoss()


@pytest.mark.parametrize(("budget", "micro_batches"), [(16, 2), (4096, 1)])
def test_loss_is_token_mean_over_the_whole_step(tiny_qwen2, budget, micro_batches):
    # Sample A: 8 prompt + 2 loss tokens with loss 1.0 (10 tokens); sample B: 6 prompt + 6 loss
    # tokens with loss 0.5 (12 tokens). With budget 16 they cannot share a micro-batch (22 > 16).
    # Step token-mean = (2 * 1.0 + 6 * 0.5) / 8 = 5 / 8 = 0.625; a mean of the micro-batch means
    # would be (1.0 + 0.5) / 2 = 0.75.
    a = sample(list(range(1, 9)), [9, 10], advantage=1.0)
    b = sample(list(range(20, 26)), [30, 31, 32, 33, 34, 35], advantage=0.5)
    metrics = backend(tiny_qwen2(0), micro_batch_tokens=budget).train_step(
        [a, b], advantage_as_loss
    )
    assert metrics["perf/micro_batches"] == micro_batches
    assert metrics["loss"] == 0.625
    # Objective metrics are weighted by each micro-batch's share of loss tokens:
    # with 2 micro-batches 1.0 * 2/8 + 0.5 * 6/8 = 0.625; with 1 it is the plain mean, 0.625.
    assert metrics["obj/mean"] == pytest.approx(0.625, abs=1e-7)
    assert metrics["perf/tokens"] == 22.0


def policy_samples(model) -> list[TrainSample]:
    """Four samples with real advantages; behavior logprobs near the model's (some clipped)."""
    specs = [
        ([1, 2, 3, 4], [5, 6], 1.0),
        ([7, 8, 9], [10, 11, 12, 13, 14, 15], -0.5),
        ([16, 17, 18, 19, 20, 21], [22, 23, 24, 25, 26, 27], 0.75),
        ([28, 29], [30, 31, 32], -1.25),
    ]
    out = []
    with torch.no_grad():
        for k, (p, c, adv) in enumerate(specs):
            lp = manual_logprobs(model, p + c)[len(p) :]
            # Offsets -0.3..+0.3: ratios exp(-+0.3) = 0.74/1.35 fall outside the 0.2 clip range.
            shift = torch.linspace(-0.3, 0.3, len(c)) * (1 if k % 2 else -1)
            out.append(sample(p, c, adv, behavior=(lp + shift).tolist()))
    return out


def reference_grads(model, samples: list[TrainSample]) -> dict[str, torch.Tensor]:
    """The token-mean PPO gradient computed by hand: each sample alone, summed, / all tokens."""
    model.zero_grad(set_to_none=True)
    n = sum(sum(s.loss_mask) for s in samples)  # 2 + 6 + 6 + 3 = 17 loss tokens
    for s in samples:
        lp = manual_logprobs(model, s.token_ids)
        mask = torch.tensor(s.loss_mask)
        per_token, _ = ppo_clip(
            lp,
            torch.tensor(s.behavior_logprobs),
            torch.tensor(s.advantages),
            mask,
            torch.zeros(len(s), dtype=torch.long),
            PolicyLossParams(0.2, 0.2, 3.0),
        )
        ((per_token * mask).sum() / n).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def test_split_micro_batches_give_the_single_batch_gradient(tiny_qwen2):
    objective = PPO
    samples = policy_samples(tiny_qwen2(0))
    expected = reference_grads(tiny_qwen2(0), samples)

    small = backend(tiny_qwen2(0), micro_batch_tokens=16, grad_clip=NO_CLIP, lr=1e-3)
    big = backend(tiny_qwen2(0), micro_batch_tokens=4096, grad_clip=NO_CLIP, lr=1e-3)
    m_small = small.train_step(samples, objective)
    m_big = big.train_step(samples, objective)
    # Lengths 6, 9, 12, 5 under 16 tokens: 12 | 9 + 6 | 5 -> 3 micro-batches; 32 <= 4096 -> 1.
    assert m_small["perf/micro_batches"] == 3 and m_big["perf/micro_batches"] == 1
    assert 0 < m_small["clip/fraction"] < 1  # both branches of the clipped surrogate are used
    assert m_small["loss"] == pytest.approx(m_big["loss"], abs=1e-6)
    # A maximum is reduced as a maximum, not token-weighted, whatever the packing.
    assert m_small["ratio/max"] == pytest.approx(m_big["ratio/max"], rel=1e-6)
    assert m_big["ratio/max"] > m_big["ratio/mean"]
    assert m_small["grad_norm"] == pytest.approx(m_big["grad_norm"], rel=1e-5)

    # The optimizer step left the accumulated gradient on the parameters (zeroed at step start).
    small_params = dict(small.model.named_parameters())
    for name, p in big.model.named_parameters():
        torch.testing.assert_close(small_params[name].grad, p.grad, atol=1e-6, rtol=0)
        torch.testing.assert_close(p.grad, expected[name], atol=1e-6, rtol=0)
        # AdamW's first step is lr * g / (|g| + 1e-8): where g is near 0 (k_proj.bias here,
        # ~2e-8) it amplifies the packing's rounding of g up to lr / 1e-8 times. The weights
        # are compared where the gradient is clearly not 0 (the gradients are checked above).
        clear = p.grad.abs() > 1e-6
        torch.testing.assert_close(small_params[name].data[clear], p.data[clear], atol=1e-6, rtol=0)


def test_a_policy_step_changes_every_parameter_tensor(tiny_qwen2):
    model = tiny_qwen2(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    objective = PPO
    metrics = backend(model, lr=1e-3).train_step(policy_samples(model), objective)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    unchanged = [k for k, v in model.state_dict().items() if torch.equal(v, before[k])]
    assert unchanged == []


def test_step_without_loss_tokens_is_skipped(tiny_qwen2):
    model = tiny_qwen2(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    b = backend(model)
    metrics = b.train_step([sample([1, 2, 3], [])], SFTObjective())
    assert "loss" not in metrics and metrics["perf/tokens"] == 3.0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert b.scheduler.last_epoch == 0  # no optimizer step, so no schedule step


def offset_samples(model, offset: float) -> list[TrainSample]:
    """Samples whose behavior logprobs are the model's own plus ``offset`` on every loss token."""
    out = []
    with torch.no_grad():
        for p, c in [([1, 2, 3], [4, 5, 6]), ([7, 8], [9, 10]), ([11, 12, 13], [14, 15, 16, 17])]:
            lp = manual_logprobs(model, p + c)[len(p) :] + offset
            out.append(sample(p, c, advantage=1.0, behavior=lp.tolist()))
    return out


def test_mismatch_metric_is_mean_abs_logprob_gap(tiny_qwen2):
    # Every loss token's behavior logprob is 0.5 above the trainer's: mean |gap| = 0.5 (measured
    # for an objective on engine-sampled tokens, before the update).
    model = tiny_qwen2(0)
    metrics = backend(model).train_step(offset_samples(model, 0.5), PPO)
    assert metrics["mismatch/abs_logprob_diff"] == pytest.approx(0.5, abs=1e-5)
    # every gap is 0.5, so the largest one is too
    assert metrics["mismatch/max_abs_logprob_diff"] == pytest.approx(0.5, abs=1e-5)


def test_mismatch_metric_with_two_mini_batches(tiny_qwen2):
    # The first mini-batch's, before any update: the second would see the updated weights.
    model = tiny_qwen2(0)
    metrics = backend(model, mini_batches=2).train_step(offset_samples(model, 0.5), PPO)
    assert metrics["mismatch/abs_logprob_diff"] == pytest.approx(0.5, abs=1e-5)


def test_loss_metric_when_there_are_more_mini_batches_than_samples(tiny_qwen2):
    one = [sample([1, 2], [3, 4])]  # chunks for k=2: [[0], []]; only one optimizer step runs
    single = backend(tiny_qwen2(0)).train_step(one, SFTObjective())["loss"]
    split = backend(tiny_qwen2(0), mini_batches=2).train_step(one, SFTObjective())["loss"]
    assert split == pytest.approx(single, rel=1e-6)


def test_mini_batches_take_that_many_optimizer_steps(tiny_qwen2):
    model = tiny_qwen2(0)
    b = backend(model, mini_batches=2)
    b.train_step(offset_samples(model, 0.0), SFTObjective())
    assert b.scheduler.last_epoch == 2


def test_frozen_backend_has_no_optimizer(tiny_qwen2):
    model = tiny_qwen2(0)
    frozen = TorchBackend(model, TrainerConfig(), total_steps=1, trainable=False)
    assert frozen.optimizer is None
    assert not any(p.requires_grad for p in model.parameters())
    with pytest.raises(AssertionError, match="frozen backend"):
        frozen.train_step([sample([1], [2])], SFTObjective())


@pytest.mark.parametrize(
    ("schedule", "warmup", "total", "expected"),
    [
        # Warmup (s + 1) / 2 for s < 2; then progress = (s - 2) / (6 - 2) and
        # cosine 0.5 * (1 + cos(pi * progress)): s=3 -> 0.5 * (1 + cos(pi/4)) = 0.8535534,
        # s=4 -> 0.5, s=5 -> 0.5 * (1 - 0.7071068) = 0.1464466, s=6 -> 0, s=8 clamped -> 0.
        (
            "cosine",
            2,
            6,
            {0: 0.5, 1: 1.0, 2: 1.0, 3: 0.8535534, 4: 0.5, 5: 0.1464466, 6: 0.0, 8: 0.0},
        ),
        # No warmup; linear 1 - s / 4, floored at 0.
        ("linear", 0, 4, {0: 1.0, 1: 0.75, 2: 0.5, 3: 0.25, 4: 0.0, 6: 0.0}),
        # Warmup 1/3, 2/3, then constant 1.
        ("constant", 3, 10, {0: 1 / 3, 1: 2 / 3, 2: 1.0, 3: 1.0, 50: 1.0}),
    ],
)
def test_lr_schedule_golden(schedule, warmup, total, expected):
    f = lr_lambda(schedule, warmup, total)
    assert {s: f(s) for s in expected} == pytest.approx(expected, abs=1e-7)


def test_backend_applies_the_schedule_per_optimizer_step(tiny_qwen2):
    # lr 1e-2, cosine, warmup 2, 6 steps: steps 0..3 run at 1e-2 * (0.5, 1.0, 1.0, 0.8535534).
    model = tiny_qwen2(0)
    b = TorchBackend(
        model, TrainerConfig(lr=1e-2, warmup_steps=2, lr_schedule="cosine"), total_steps=6
    )
    applied = []
    for _ in range(4):
        applied.append(b.optimizer.param_groups[0]["lr"])
        b.train_step([sample([1, 2], [3, 4])], SFTObjective())
    assert applied == pytest.approx([5e-3, 1e-2, 1e-2, 8.535534e-3], abs=1e-9)


def test_lr_metric_is_the_lr_the_step_used(tiny_qwen2):
    b = TorchBackend(
        tiny_qwen2(0), TrainerConfig(lr=1e-2, warmup_steps=2, lr_schedule="cosine"), total_steps=6
    )
    metrics = b.train_step([sample([1, 2], [3, 4])], SFTObjective())
    assert metrics["lr"] == pytest.approx(5e-3)  # warmup step 0: 1e-2 * (0 + 1) / 2


def test_grad_clip_zero_means_no_clipping(tiny_qwen2):
    # max_norm 0 would scale every gradient to 0 and Adam would not move: 0 must mean "off",
    # so the step equals the one with a clip too large to ever bite.
    updates = []
    for clip in (0.0, NO_CLIP):
        model = tiny_qwen2(0)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        backend(model, lr=1e-3, grad_clip=clip).train_step(policy_samples(model), PPO)
        updates.append({k: v - before[k] for k, v in model.state_dict().items()})
    assert all(u.abs().sum() > 0 for u in updates[0].values())
    for k, u in updates[0].items():
        torch.testing.assert_close(u, updates[1][k], rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    ("policy_loss", "loss_agg"),
    [
        ("ppo", "token-mean"),
        ("ppo", "seq-mean-token-mean"),
        ("ppo", "seq-mean-token-sum"),
        ("ppo", "seq-mean-token-sum-norm"),
        ("gspo", "seq-mean-token-mean"),
        ("vanilla", "seq-mean-token-sum"),
    ],
)
def test_e_a_fully_masked_sample_changes_neither_loss_nor_gradient(
    tiny_qwen2, policy_loss, loss_agg
):
    # Overlong filtering leaves a truncated sample with an all-False loss mask. Adding such a
    # sample (with a large advantage that would dominate if counted) must not change the
    # loss or the gradient, in any aggregation (its tokens and its sequence are not counted).
    cfg = AlgorithmConfig(policy_loss=policy_loss, loss_agg=loss_agg)
    objective = PolicyObjective.from_config(cfg, max_tokens=32)
    model = tiny_qwen2(0)
    kept = policy_samples(model)
    filtered = sample([1, 2, 3], [4, 5, 6, 7], advantage=50.0)
    filtered.loss_mask = [False] * len(filtered)
    losses, grads = [], []
    for batch in (kept, [*kept, filtered]):
        b = backend(tiny_qwen2(0), grad_clip=NO_CLIP, lr=1e-3)
        losses.append(b.train_step(batch, objective)["loss"])
        grads.append({k: p.grad.clone() for k, p in b.model.named_parameters()})
    # The masked sample makes the packed row 39 tokens instead of 32, so the same sums are taken
    # in another order: equal up to float32 rounding, not bit for bit (1 ULP of a gradient near
    # 1 is 1.2e-7, seen on an AVX2-only CPU). The GSPO loss is 0 by the cancellation of terms
    # near 0.3, hence the absolute term. The bounds are those of the shared-prefix checks.
    assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-6)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_entropy_metric_is_the_mean_next_token_entropy_over_trained_tokens(tiny_qwen2):
    model = tiny_qwen2(0)
    s = sample([1, 2, 3], [4, 5])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([s.token_ids]), use_cache=False).logits[0]
        # token t is predicted from logits[t - 1]: trained tokens 3 and 4 use logits 2 and 3
        h = torch.distributions.Categorical(logits=logits[2:4]).entropy()
    objective = PolicyObjective.from_config(AlgorithmConfig(), max_tokens=32)
    metrics = backend(model, lr=1e-9).train_step([s], objective)
    assert metrics["entropy/mean"] == pytest.approx(h.mean().item(), rel=1e-5)


def test_entropy_bonus_enters_the_loss(tiny_qwen2):
    s = sample([1, 2, 3], [4, 5], advantage=0.0)  # zero advantage: the loss is the bonus alone
    cfg = AlgorithmConfig(entropy_coef=0.5)
    metrics = backend(tiny_qwen2(0)).train_step(
        [s], PolicyObjective.from_config(cfg, max_tokens=32)
    )
    # token-mean of -0.5 * H_t = -0.5 * mean entropy (the metric is taken before the update)
    assert metrics["loss"] == pytest.approx(-0.5 * metrics["entropy/mean"], rel=1e-5)
    assert metrics["grad_norm"] > 0


def test_importance_sampling_needs_recomputed_old_logprobs(tiny_qwen2):
    cfg = AlgorithmConfig(importance_sampling="tis_token")
    objective = PolicyObjective.from_config(cfg, max_tokens=32)
    with pytest.raises(ValueError, match="old logprobs"):
        backend(tiny_qwen2(0)).train_step([sample([1], [2, 3], 1.0)], objective)


def test_value_head_outputs_are_aligned_like_logprobs(tiny_value_model):
    model = tiny_value_model
    critic = TorchBackend(model, TrainerConfig(), total_steps=1, head="value")
    ids = [1, 2, 3, 4]
    (values,) = critic.compute_values([sample(ids[:2], ids[2:])])
    with torch.no_grad():
        raw = model(input_ids=torch.tensor([ids])).logits[0, :, 0]
    # value of the state before token t = the head's output at position t - 1; 0 at t = 0
    assert values == pytest.approx([0.0, *raw[:-1].tolist()], abs=1e-6)


def test_demonstrations_report_no_engine_mismatch(tiny_qwen2):
    # SFT tokens were not sampled by an engine: nothing to compare their logprobs with.
    model = tiny_qwen2(0)
    metrics = backend(model).train_step(offset_samples(model, 0.5), SFTObjective())
    assert not [name for name in metrics if name.startswith("mismatch/")]
