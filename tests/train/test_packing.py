"""Tests for treadle.train.packing: micro-batch planning, packing, and the packed attention."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from treadle.core.types import TrainSample
from treadle.train.packing import pack, plan_micro_batches

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sample(token_ids: list[int], prompt_len: int = 1, ref: bool = False) -> TrainSample:
    n = len(token_ids)
    return TrainSample(
        token_ids=token_ids,
        loss_mask=[False] * prompt_len + [True] * (n - prompt_len),
        behavior_logprobs=[0.0] * prompt_len + [-0.5] * (n - prompt_len),
        advantages=[0.0] * prompt_len + [1.0] * (n - prompt_len),
        policy_version=0,
        group_id="g",
        ref_logprobs=[-1.0] * n if ref else [],
    )


def test_plan_first_fit_decreasing_golden():
    # Sorted by length: 7(i2) 6(i4) 5(i0) 4(i5) 3(i1) 2(i3), budget 10.
    # 7 -> new bin A (room 3); 6 -> new bin B (room 4); 5 -> new bin C (room 5);
    # 4 -> B (room 0); 3 -> A (room 0); 2 -> C (room 3). Bins A={2,1}, B={4,5}, C={0,3}.
    assert plan_micro_batches([5, 3, 7, 2, 6, 4], budget=10) == [[1, 2], [4, 5], [0, 3]]


def test_plan_exact_fit_shares_a_bin():
    assert plan_micro_batches([5, 5], budget=10) == [[0, 1]]
    assert plan_micro_batches([5, 6], budget=10) == [[1], [0]]


def test_plan_oversize_sample_gets_a_bin_of_its_own():
    # 20 > budget 10: alone (room -10 takes nothing); 4 then 3 share the next bin (7 <= 10).
    assert plan_micro_batches([3, 20, 4], budget=10) == [[1], [0, 2]]


def test_plan_empty():
    assert plan_micro_batches([], budget=10) == []


@pytest.mark.parametrize("seed", range(5))
def test_plan_respects_budget_and_covers_every_index_once(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 60) for _ in range(40)]
    budget = 50
    plan = plan_micro_batches(lengths, budget)
    flat = [i for b in plan for i in b]
    assert sorted(flat) == list(range(len(lengths)))  # each index exactly once
    for b in plan:
        assert b == sorted(b)
        total = sum(lengths[i] for i in b)
        assert total <= budget or len(b) == 1, (b, total)
    # An oversize sample (> 50) is never packed with another.
    for b in plan:
        if any(lengths[i] > budget for i in b):
            assert len(b) == 1


def test_pack_concatenates_and_restarts_positions():
    samples = [sample([1, 2, 3]), sample([4, 5]), sample([6, 7, 8, 9], prompt_len=2)]
    mb = pack(samples, [2, 0])
    assert mb.sample_index == [2, 0]
    assert mb.seq_lens == [4, 3]
    assert mb.num_tokens == 7
    assert mb.input_ids.tolist() == [[6, 7, 8, 9, 1, 2, 3]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert mb.loss_mask.tolist() == [False, False, True, True, False, True, True]
    assert mb.behavior_logprobs.tolist() == [0.0, 0.0, -0.5, -0.5, 0.0, -0.5, -0.5]
    assert mb.advantages.tolist() == [0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert mb.input_ids.dtype == torch.long and mb.loss_mask.dtype == torch.bool
    assert mb.ref_logprobs is None


def test_pack_ref_logprobs_only_when_every_sample_has_them():
    with_ref = [sample([1, 2], ref=True), sample([3, 4, 5], ref=True)]
    assert pack(with_ref, [0, 1]).ref_logprobs.tolist() == [-1.0] * 5
    assert pack([*with_ref, sample([6, 7])], [0, 1, 2]).ref_logprobs is None


def test_per_sample_splits_by_sequence_length():
    mb = pack([sample([1, 2, 3, 4]), sample([5, 6, 7])], [0, 1])  # 4 + 3 tokens, no sharing
    values = torch.arange(7, dtype=torch.float32)
    assert mb.per_sample(values) == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]


def logprobs_alone(model, ids: list[int]) -> torch.Tensor:
    """Reference: run one sequence by itself; logprob of token t given tokens < t, [L - 1]."""
    x = torch.tensor([ids])
    logits = model(input_ids=x, use_cache=False).logits[0]
    return F.log_softmax(logits[:-1], dim=-1).gather(1, x[0, 1:, None])[:, 0]


def logprobs_packed(model, mb, attention_mask=None) -> list[torch.Tensor]:
    logits = model(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        attention_mask=attention_mask,
        use_cache=False,
    ).logits[0]
    out, start = [], 0
    for n in mb.seq_lens:
        seq_logits, seq_ids = logits[start : start + n], mb.input_ids[0, start : start + n]
        out.append(F.log_softmax(seq_logits[:-1], dim=-1).gather(1, seq_ids[1:, None])[:, 0])
        start += n
    return out


@torch.no_grad()
def test_packed_sequences_do_not_attend_across_boundaries(tiny_qwen2):
    """transformers must build a block-diagonal causal mask from the restarting position_ids.

    If it did not, every token of the 2nd and 3rd sequences would also attend to the tokens
    before it in the row, and their logprobs would differ from the sequences run alone.
    """
    model = tiny_qwen2(0).eval()
    seqs = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [17, 18]]
    mb = pack([sample(s) for s in seqs], list(range(len(seqs))))
    packed = logprobs_packed(model, mb)
    for s, lp in zip(seqs, packed, strict=True):
        torch.testing.assert_close(lp, logprobs_alone(model, s), atol=1e-5, rtol=0)

    # Control, so the check above can fail: with an explicit all-ones attention mask the packed
    # row is one long causal sequence and the later sequences see their predecessors.
    leaky = logprobs_packed(model, mb, attention_mask=torch.ones_like(mb.input_ids))
    torch.testing.assert_close(leaky[0], packed[0], atol=1e-5, rtol=0)  # nothing before it
    for later, alone in zip(leaky[1:], seqs[1:], strict=True):
        assert (later - logprobs_alone(model, alone)).abs().max() > 1e-3
