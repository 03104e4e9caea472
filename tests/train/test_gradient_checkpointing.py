"""Gradient checkpointing (``trainer.gradient_checkpointing``): the same loss and gradients as
keeping the activations, on a packed micro-batch whose groups share their prompts (the per-sample
attention is recomputed in the backward pass), for a policy and a critic; the layers really run
twice, and the activation memory at the peak is lower."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_qwen2_config
from transformers import Qwen2ForCausalLM, Qwen2ForTokenClassification

from treadle.config import AlgorithmConfig, TrainerConfig
from treadle.core.batch import StepTotals
from treadle.core.errors import UserError
from treadle.core.types import TrainSample
from treadle.train.checkpointing import enable_gradient_checkpointing
from treadle.train.memory import peak_bytes
from treadle.train.objectives import PolicyObjective, ValueObjective
from treadle.train.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

POLICY = PolicyObjective.from_config(AlgorithmConfig(), max_tokens=16)


def batch(completion: int = 6) -> list[TrainSample]:
    """Two groups of three samples sharing a 5-token prompt, and one sample alone."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for g, prompt in (("a", [3, 9, 4, 1, 5]), ("b", [2, 6, 5, 3, 8])):
        for i in range(3):
            ids = prompt + torch.randint(1, 64, (completion + i,), generator=gen).tolist()
            n, p = len(ids), len(prompt)
            out.append(
                TrainSample(
                    token_ids=ids,
                    loss_mask=[t >= p for t in range(n)],
                    behavior_logprobs=[0.0] * p + [-1.5] * (n - p),
                    advantages=[0.0] * p + [(-1.0) ** i] * (n - p),
                    policy_version=0,
                    group_id=g,
                    values=torch.randn(n, generator=gen).tolist(),
                    returns=torch.randn(n, generator=gen).tolist(),
                )
            )
    out.append(TrainSample([7, 7, 1, 2, 3], [False, False, True, True, True], [0.0] * 5,
                           [0.5] * 5, 0, "c", values=[0.0] * 5, returns=[1.0] * 5))  # fmt: skip
    return out


def build(head: str, checkpointing: bool, layers: int = 2) -> TorchBackend:
    torch.manual_seed(0)  # the same weights with and without checkpointing
    if head == "value":
        config = tiny_qwen2_config(num_labels=1, classifier_dropout=0.0, num_hidden_layers=layers)
        model = Qwen2ForTokenClassification(config).float()
    else:
        model = Qwen2ForCausalLM(tiny_qwen2_config(num_hidden_layers=layers)).float()
    cfg = TrainerConfig(micro_batch_tokens=512, gradient_checkpointing=checkpointing)
    return TorchBackend(model, cfg, 1, head=head)


def loss_and_grads(backend: TorchBackend, samples, objective):
    """One micro-batch's forward and backward: (loss, {name: grad})."""
    backend.model.train()
    (mb,) = backend._micro_batches(samples)
    assert mb.shared  # the groups' prompts are computed once, under the packed attention
    step = StepTotals(
        tokens=sum(sum(s.loss_mask) for s in samples),
        sequences=sum(any(s.loss_mask) for s in samples),
    )
    out = backend.forward(mb, objective.entropy_grad, loss_tokens_only=True)
    loss, _ = objective(out, mb, step)
    backend.backward(loss)
    return loss.item(), {n: p.grad for n, p in backend.model.named_parameters()}


@pytest.mark.parametrize("head", ["lm", "value"])
def test_checkpointing_gives_the_same_loss_and_gradients(head):
    objective = POLICY if head == "lm" else ValueObjective(value_clip=0.2)
    plain, checkpointed = build(head, False), build(head, True)
    assert plain.packing == checkpointed.packing == "shared"
    runs = {}  # decoder-layer forward calls per backend: 2 layers, once each or twice with
    for backend in (plain, checkpointed):  # the recomputation in the backward pass (a pre-hook:
        runs[backend] = []  # the recomputation stops once it has what the backward needs)
        for layer in backend.model.base_model.layers:
            layer.register_forward_pre_hook(lambda *_, r=runs[backend]: r.append(1))
    loss0, grads0 = loss_and_grads(plain, batch(), objective)
    loss1, grads1 = loss_and_grads(checkpointed, batch(), objective)
    assert (len(runs[plain]), len(runs[checkpointed])) == (2, 4)
    assert loss1 == pytest.approx(loss0, abs=1e-6) and loss0 != 0.0
    assert grads0.keys() == grads1.keys()
    for name, g in grads0.items():
        assert g is not None and g.abs().max() > 0, name  # every tensor got a gradient
        torch.testing.assert_close(grads1[name], g, atol=1e-6, rtol=0, msg=name)


def test_checkpointing_lowers_the_activation_peak():
    # 4 layers over 2 x (5 + 40..42) + 5 = 254 packed tokens: kept, each layer's attention and
    # MLP intermediates ([N, 64] several times, [N, 128] MLP) stay alive until the backward;
    # checkpointed, each layer keeps only its input [N, 32] and one layer's intermediates
    # exist at a time, so the peak must drop by well over a third.
    samples = batch(completion=40)
    peaks = []
    for checkpointing in (False, True):
        backend = build("lm", checkpointing, layers=4)
        work = lambda b=backend: loss_and_grads(b, samples, POLICY)  # noqa: E731
        peaks.append(peak_bytes(work, backend.device))
    plain, checkpointed = peaks
    assert 0 < checkpointed < 0.66 * plain, peaks


def test_a_model_without_checkpointing_support_is_refused():
    model = Qwen2ForCausalLM(tiny_qwen2_config())
    model.supports_gradient_checkpointing = False
    with pytest.raises(UserError, match=r"trainer\.gradient_checkpointing"):
        enable_gradient_checkpointing(model)
