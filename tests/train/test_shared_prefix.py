"""Shared-prefix packing and per-sample packed attention: layouts derived by hand, and every
output (logprobs, values, losses, gradients) equal to computing each sample alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2ForCausalLM

from treadle.config import AlgorithmConfig, TrainerConfig
from treadle.core.types import TrainSample
from treadle.train.objectives import PolicyObjective
from treadle.train.packing import pack, plan_shared_micro_batches, shared_prefix_len
from treadle.train.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sample(ids: list[int], prompt: int, group: str = "g", adv: float = 1.0) -> TrainSample:
    n = len(ids)
    return TrainSample(
        token_ids=ids,
        loss_mask=[t >= prompt for t in range(n)],
        behavior_logprobs=[0.0] * prompt + [-1.5] * (n - prompt),
        advantages=[0.0] * prompt + [adv] * (n - prompt),
        policy_version=0,
        group_id=group,
    )


def test_shared_prefix_len_stops_at_the_first_difference_or_trained_token():
    a, b = sample([1, 2, 3, 4, 5], 3), sample([1, 2, 3, 6], 3)
    assert shared_prefix_len([a, b]) == 3  # the whole prompt [1, 2, 3]
    assert shared_prefix_len([a, sample([1, 2, 9, 6], 3)]) == 2  # differ at token 2
    assert shared_prefix_len([a, sample([1, 2, 3, 4], 2)]) == 2  # b trains from token 2
    assert shared_prefix_len([a]) == 0  # nothing to share with
    assert shared_prefix_len([a, sample([7, 2, 3], 3)]) == 0


def test_pack_with_shared_prefix_golden_layout():
    # Group g: [1 2 | 3 4] and [1 2 | 5] share the prompt [1 2]; group h: [6 | 7] alone.
    samples = [sample([1, 2, 3, 4], 2), sample([1, 2, 5], 2), sample([6, 7], 1, "h")]
    mb = pack(samples, [0, 1, 2], share_prefix=True)
    # Packed: prefix 1 2 (positions 0 1), then 3 4 (2 3), then 5 (2), then 6 7 (0 1).
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1]]
    # Token 5 (index 4) follows the prompt's last token (index 1), not token 4 (index 3).
    assert mb.prev.tolist() == [-1, 0, 1, 2, 1, -1, 5]
    assert mb.sample_tokens.tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 6]  # 4 + 3 + 2 tokens
    assert mb.seq_lens == [4, 3, 2] and mb.num_tokens == 7 and mb.shared
    # Attention rows: each sample's positions, right-padded with 0 to width 4.
    assert [g.tolist() for g in mb.attn_gather] == [[[0, 1, 2, 3], [0, 1, 4, 0], [5, 6, 0, 0]]]
    # Output of each position from (row, column), flattened row * 4 + column: the prefix from
    # row 0, token 5 from row 1 column 2 (= 6), tokens 6 7 from row 2 columns 0 1 (= 8, 9).
    assert mb.attn_scatter.tolist() == [0, 1, 2, 3, 6, 8, 9]
    assert mb.segments.tolist() == [0, 0, 0, 0, 1, 2, 2]
    assert mb.loss_mask.tolist() == [False, False, True, True, True, False, True]
    assert mb.per_sample(torch.arange(7.0)) == [[0, 1, 2, 3], [0, 1, 4], [5, 6]]
    # Without sharing: the plain concatenation.
    plain = pack(samples, [0, 1, 2])
    assert plain.input_ids.tolist() == [[1, 2, 3, 4, 1, 2, 5, 6, 7]] and not plain.shared
    assert plain.prev.tolist() == [-1, 0, 1, 2, -1, 4, 5, -1, 7]


def test_rows_of_very_different_lengths_get_their_own_attention_chunk():
    # A 3-token sample then an 8-token one: 2 x 3 < 8, so the short row is not padded to 8.
    # Rows longest first: chunk 0 = [the 8-token sample] (width 8), chunk 1 = [the 3-token
    # one] (width 3); flat outputs: chunk 0 at 0..7, chunk 1 at 8..10.
    mb = pack([sample([9, 10, 11], 1, "b"), sample(list(range(1, 9)), 1, "a")], [0, 1], True)
    assert [g.tolist() for g in mb.attn_gather] == [[[3, 4, 5, 6, 7, 8, 9, 10]], [[0, 1, 2]]]
    # Packed positions 0-2 (the short sample) read outputs 8-10; positions 3-10 read 0-7.
    assert mb.attn_scatter.tolist() == [8, 9, 10, 0, 1, 2, 3, 4, 5, 6, 7]


def test_plan_shared_keeps_a_group_together_and_counts_its_prefix_once():
    # Three samples of 10 tokens sharing a 6-token prompt: 10 + 4 + 4 = 18 tokens.
    group = [sample(list(range(1, 7)) + [20 + i] * 4, 6) for i in range(3)]
    other = [sample([50, 51, 52, 53], 2, "h")]
    assert plan_shared_micro_batches(group + other, budget=22) == [[0, 1, 2, 3]]  # 18 + 4
    # Budget 15: chunk [0, 1] (14 tokens) and chunk [2] (10, its prompt again); the 4-token
    # sample fills chunk [2]'s bin (10 + 4 <= 15), first-fit decreasing.
    assert plan_shared_micro_batches(group + other, budget=15) == [[0, 1], [2, 3]]


def manual_logprobs(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    lp = F.log_softmax(model(input_ids=x).logits[0, :-1], -1).gather(1, x[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


def batch() -> list[TrainSample]:
    """Two groups of four samples sharing their prompts, plus a sample alone, mixed lengths."""
    g = torch.Generator().manual_seed(0)
    out = []
    for group, prompt in (("a", [3, 9, 4, 1, 5]), ("b", [2, 6, 5, 3, 5, 8, 9])):
        for i in range(4):
            n = int(torch.randint(1, 9, (1,), generator=g))
            completion = torch.randint(1, 64, (n,), generator=g).tolist()
            out.append(sample(prompt + completion, len(prompt), group, adv=(-1.0) ** i))
    out.append(sample([7, 7, 1, 2, 3], 2, "c", adv=0.5))
    return out


@torch.no_grad()
def test_shared_prefix_logprobs_equal_each_sample_alone(tiny_qwen2):
    model = tiny_qwen2(0).eval()
    b = TorchBackend(model, TrainerConfig(micro_batch_tokens=64), 1, trainable=False)
    assert b.packing == "shared"  # Qwen2 passes the layout to its attention
    samples = batch()
    mb = b._micro_batches(samples)
    assert any(m.shared for m in mb)  # the prompts really are shared
    assert sum(m.num_tokens for m in mb) < sum(len(s) for s in samples)
    for s, lp in zip(samples, b.compute_logprobs(samples), strict=True):
        torch.testing.assert_close(
            torch.tensor(lp), manual_logprobs(model, s.token_ids), atol=1e-5, rtol=0
        )


def test_shared_prefix_update_equals_plain_packing(tiny_qwen2):
    """One PPO step with shared prefixes, per-sample attention and logits only on trained
    tokens gives the loss, metrics and weights of plain packing with the model's own attention
    and full logits (the path every earlier test checked against per-sample math)."""
    samples = batch()
    objective = PolicyObjective.from_config(AlgorithmConfig(), max_tokens=16)
    shared = TorchBackend(tiny_qwen2(0), TrainerConfig(micro_batch_tokens=40, grad_clip=0), 1)
    plain = TorchBackend(tiny_qwen2(0), TrainerConfig(micro_batch_tokens=40, grad_clip=0), 1)
    plain.packing, plain._logits_to_keep = "plain", False
    assert not any(m.shared for m in plain._micro_batches(samples))
    m1, m2 = shared.train_step(samples, objective), plain.train_step(samples, objective)
    for key in ("loss", "grad_norm", "entropy/mean", "clip/fraction", "ratio/mean"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-7), key
    assert m1["perf/micro_batches"] < m2["perf/micro_batches"]  # fewer tokens, fewer bins
    for (name, p1), (_, p2) in zip(
        shared.model.named_parameters(), plain.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p1, p2, atol=1e-6, rtol=1e-5, msg=name)
    # And the step moved the weights, so the equality above is not of two untouched models.
    assert (shared.model.lm_head.weight - tiny_qwen2(0).lm_head.weight).abs().max() > 1e-5


def _indexings(root: torch.Tensor) -> list[torch.Tensor]:
    """The index tensors of every ``x[index]`` (IndexBackward0) in ``root``'s autograd graph:
    the backward of each is an index_put with accumulate, on CPU atomic adds from several
    threads wherever an index repeats."""
    seen, todo, found = set(), [root.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "IndexBackward0":
            found += [i for i in node._saved_indices if i is not None]
        todo += [fn for fn, _ in node.next_functions]
    return found


@pytest.mark.parametrize("logits_to_keep", [True, False])
def test_no_gradient_is_summed_into_a_repeated_row_by_indexing(tiny_qwen2, logits_to_keep):
    # A shared prompt's last position predicts the first token of each of its samples, so the
    # positions scored repeat. Indexed with repeats (logits_to_keep=sources or out[sources]),
    # their gradients were summed by atomic adds in the threads' order: the default run's
    # update differed in its last bits under load (replayed on 2 threads beside a busy
    # process: 3 of 3 replays of one step off the idle one, now 4 of 4 equal). Every indexing
    # left in the graph has distinct indices; the repeats go through index_select.
    b = TorchBackend(tiny_qwen2(0), TrainerConfig(micro_batch_tokens=64), 1)
    b._logits_to_keep = logits_to_keep
    repeated = 0
    for mb in b._micro_batches(batch()):
        sources = mb.prev[(mb.prev >= 0) & mb.loss_mask]
        repeated += sources.numel() - sources.unique().numel()
        out = b.forward(mb, loss_tokens_only=True)
        for index in _indexings(out.logprobs):
            assert index.unique().numel() == index.numel(), index
    assert repeated > 0  # the batch's shared prompts make repeats: the check above has work


@torch.no_grad()
def test_shared_prefix_values_equal_each_sample_alone(tiny_value_model):
    model = tiny_value_model.eval()
    b = TorchBackend(model, TrainerConfig(micro_batch_tokens=64), 1, trainable=False, head="value")
    assert b.packing == "shared"
    for s, v in zip(batch(), b.compute_values(batch()), strict=True):
        alone = model(input_ids=torch.tensor([s.token_ids])).logits[0, :, 0]
        expected = torch.cat([torch.zeros(1), alone[:-1]])  # value of the state before each token
        torch.testing.assert_close(torch.tensor(v), expected, atol=1e-5, rtol=0)


class NoKwargsQwen2(Qwen2ForCausalLM):
    """A model whose forward does not pass extra keyword arguments to its layers."""

    def forward(self, input_ids=None, position_ids=None, use_cache=None, logits_to_keep=0):
        return super().forward(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
        )


def probed_copy(cls: type, base: Qwen2ForCausalLM) -> tuple[TorchBackend, list[list[float]]]:
    """``base``'s weights in a model of class ``cls``, its backend (the probe has run) and its
    logprobs of :func:`batch`, checked against ``base`` computing each sample alone."""
    model = cls(copy.deepcopy(base.config)).eval()
    model.load_state_dict(base.state_dict())
    b = TorchBackend(model, TrainerConfig(micro_batch_tokens=64), 1, trainable=False)
    out = b.compute_logprobs(batch())
    for s, lp in zip(batch(), out, strict=True):
        torch.testing.assert_close(
            torch.tensor(lp), manual_logprobs(base, s.token_ids), atol=1e-5, rtol=0
        )
    return b, out


@torch.no_grad()
def test_a_model_without_the_layout_falls_back_to_its_own_attention(tiny_qwen2):
    b, _ = probed_copy(NoKwargsQwen2, tiny_qwen2(0).eval())
    assert b.packing == "plain"  # the probe saw the TypeError and turned sharing off
    assert not any(m.shared for m in b._micro_batches(batch()))


@torch.no_grad()
def test_a_windowed_model_keeps_its_own_attention(tiny_qwen2):
    """Qwen2 with a 4-token sliding window applies it through its mask alone, which the
    per-sample attention does not see: the backend must pack plainly (transformers' own
    attention, window included) and stay exact on samples longer than the window."""
    from conftest import tiny_qwen2_config

    torch.manual_seed(0)
    config = tiny_qwen2_config(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    model = Qwen2ForCausalLM(config).float().eval()
    b = TorchBackend(model, TrainerConfig(micro_batch_tokens=64), 1, trainable=False)
    assert b.packing == "plain"
    samples = batch()
    assert max(len(s) for s in samples) > 4
    for s, lp in zip(samples, b.compute_logprobs(samples), strict=True):
        torch.testing.assert_close(
            torch.tensor(lp), manual_logprobs(model, s.token_ids), atol=1e-5, rtol=0
        )


class NoPositionsQwen2(Qwen2ForCausalLM):
    """A model that ignores position_ids and keyword arguments: a packed row is one sequence."""

    def forward(self, input_ids=None, position_ids=None, use_cache=None, logits_to_keep=0):
        return super().forward(
            input_ids=input_ids, use_cache=use_cache, logits_to_keep=logits_to_keep
        )


@torch.no_grad()
def test_a_model_that_cannot_be_packed_trains_one_sample_per_micro_batch(tiny_qwen2):
    b, _ = probed_copy(NoPositionsQwen2, tiny_qwen2(0).eval())
    assert b.packing == "single"
    assert all(len(m.seq_lens) == 1 for m in b._micro_batches(batch()))


def test_the_probe_is_not_fooled_by_dropout_in_train_mode():
    """A model with dropout, built in train mode: the probe compares in eval mode."""
    from conftest import tiny_qwen2_config

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(attention_dropout=0.5)).float().train()
    b = TorchBackend(model, TrainerConfig(micro_batch_tokens=64), 1)
    assert b.packing == "shared" and model.training
