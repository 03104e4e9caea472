"""The megatron-core backend against the single-process TorchBackend on the same batch, in fp32:
tensor parallel 1 in this process and 2 in two processes over gloo (spawned, one thread each).

Both run the same objective over the same HF weights, so the loss, the gradients (mapped back
to HF names), the weights after a step and the logprobs agree to float rounding (1e-5); an HF
engine synced from the Megatron trainer's named weights reproduces its logprobs (1e-4)."""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from contracts.test_training_backend import batch
from integration.tiny import build_tiny_folder
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from treadle.config import AlgorithmConfig, TinyModelConfig, TrainerConfig
from treadle.config.sections import MegatronConfig
from treadle.core.errors import UserError
from treadle.core.protocols import EngineSpec, OptimizerState
from treadle.store.models import load_model
from treadle.train.megatron_backend import MegatronBackend
from treadle.train.objectives import PolicyObjective
from treadle.train.packing import pack
from treadle.train.torch_backend import TorchBackend

pytest.importorskip("megatron.core", reason="megatron-core is not installed (treadle[megatron])")

TOL = 1e-5
# lr 1e-3, clipping at 0.02 (the first step's gradient norm is 0.041: clipping runs)
TORCH = TrainerConfig(lr=1e-3, micro_batch_tokens=24, grad_clip=0.02)
MEGA = dataclasses.replace(TORCH, backend="megatron")
MEGA_TP2 = dataclasses.replace(MEGA, megatron=MegatronConfig(tensor_parallel=2))
POLICY = PolicyObjective.from_config(AlgorithmConfig(entropy_coef=0.01), max_tokens=8)
# 4 query heads over 2 KV heads (head dim 16) so that TP=2 splits them; tied embeddings (Qwen2)
SHAPE = TinyModelConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tokenizer_vocab_size=300,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("megatron") / "model"
    build_tiny_folder(path, cfg=SHAPE)
    return path


def step(backend: TorchBackend, samples) -> dict:
    """One optimizer step's loss, pre-clip grad norm, (clipped) gradients in HF names, and the
    weights after it, in HF names."""
    metrics = backend.optimizer_step(samples, POLICY)
    if isinstance(backend, MegatronBackend):
        grads = backend.hf_layout({n: p.grad for n, p in backend.model.named_parameters()})
    else:
        grads = {n: p.grad.clone() for n, p in backend.model.named_parameters()}
    weights = {n: t.clone() for n, t in backend.named_weights()}
    return {
        "loss": float(metrics["loss"]),
        "grad_norm": float(metrics["grad_norm"]),
        "grads": grads,
        "weights": weights,
    }


def entropies(backend: TorchBackend, samples) -> torch.Tensor:
    with torch.no_grad():
        return backend.forward(pack(samples, [0, 1, 2]), loss_tokens_only=False).entropy


def diff(a: dict, b: dict, keys) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in keys)


def expected(folder: Path) -> dict:
    """The single-process TorchBackend's numbers on :func:`batch`."""
    torch_backend = TorchBackend(load_model(folder)[0], TORCH, 10)
    samples = batch()
    out = {"logprobs": torch_backend.compute_logprobs(samples)}
    out["entropy"] = entropies(torch_backend, samples)
    out |= step(torch_backend, samples)
    out["logprobs_after"] = torch_backend.compute_logprobs(samples)
    return out


def flat(rows) -> torch.Tensor:
    return torch.tensor([x for row in rows for x in row])


def check_against_torch(got: dict, want: dict) -> None:
    assert (flat(got["logprobs"]) - flat(want["logprobs"])).abs().max() < TOL
    assert (got["entropy"] - want["entropy"]).abs().max() < TOL
    assert got["entropy"].abs().sum() > 1.0  # entropies of a 300-token vocabulary, not zeros
    assert abs(got["loss"] - want["loss"]) < TOL
    assert abs(got["grad_norm"] - want["grad_norm"]) < TOL * want["grad_norm"]
    assert want["grad_norm"] > TORCH.grad_clip  # the clipping path ran
    # each gradient within 1e-5 of its tensor's largest (they range over 3e-6 .. 3e-3); the
    # entropy bonus's gradient through the vocab-parallel sums is part of them; the tied
    # lm_head is the embedding's own parameter
    for name, g in want["grads"].items():
        assert (got["grads"][name] - g).abs().max() <= TOL * g.abs().max(), name
    assert got["weights"].keys() == want["weights"].keys()
    assert diff(got["weights"], want["weights"], want["weights"]) < TOL
    assert (flat(got["logprobs_after"]) - flat(want["logprobs_after"])).abs().max() < TOL


def test_tp1_matches_the_torch_backend(folder, one_torch_thread):
    want = expected(folder)
    samples = batch()
    backend = MegatronBackend(load_model(folder)[0], MEGA, 10)
    got = {"logprobs": backend.compute_logprobs(samples), "entropy": entropies(backend, samples)}
    before = {n: t.clone() for n, t in backend.named_weights()}
    got |= step(backend, samples)
    got["logprobs_after"] = backend.compute_logprobs(samples)
    check_against_torch(got, want)
    unchanged = [n for n in before if torch.equal(before[n], got["weights"][n])]
    assert not unchanged  # every parameter moved


def test_the_padding_token_learns_nothing_as_an_input_as_in_hf(folder, one_torch_thread):
    """HF's ``nn.Embedding(padding_idx=pad)`` gives the pad row no gradient from its input
    uses (only from the tied output layer); Megatron's embedding has no padding index, so the
    backend stops those positions' gradient itself. An engine can sample the pad token."""
    model = load_model(folder)[0]
    pad = model.get_input_embeddings().padding_idx
    assert pad is not None
    samples = batch()
    for s in samples[:3]:  # the pad token inside a prompt (its output predicts the next token)
        s.token_ids[1] = pad
    want = step(TorchBackend(model, TORCH, 10), samples)
    got = step(MegatronBackend(load_model(folder)[0], MEGA, 10), samples)
    name = "model.embed_tokens.weight"
    # without the stop the pad row's gradient differs by ~its own size (0.05 vs 0.046 on a
    # run's samples)
    assert (got["grads"][name] - want["grads"][name]).abs().max() <= TOL * want["grads"][
        name
    ].abs().max()
    assert abs(got["grad_norm"] - want["grad_norm"]) < TOL * want["grad_norm"]


def test_an_untied_llama_matches_the_torch_backend(one_torch_thread):
    """No q/k/v biases, a separate output layer, another RoPE base: the other family."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    model = LlamaForCausalLM(config)
    samples = batch()
    want_backend = TorchBackend(copy.deepcopy(model), TORCH, 10)
    want = {"logprobs": want_backend.compute_logprobs(samples)} | step(want_backend, samples)
    backend = MegatronBackend(model, MEGA, 10)
    assert "output_layer.weight" in dict(backend.model.named_parameters())
    got = {"logprobs": backend.compute_logprobs(samples)} | step(backend, samples)
    assert (flat(got["logprobs"]) - flat(want["logprobs"])).abs().max() < TOL
    assert abs(got["loss"] - want["loss"]) < TOL
    for name, g in want["grads"].items():
        assert (got["grads"][name] - g).abs().max() <= TOL * g.abs().max(), name
    assert diff(got["weights"], want["weights"], want["weights"]) < TOL


def test_packed_micro_batches_equal_one_sample_each(folder, one_torch_thread):
    samples = batch()  # lengths 5, 7, 9, 6, 8, 10: 45 tokens
    packed = MegatronBackend(
        load_model(folder)[0], dataclasses.replace(MEGA, micro_batch_tokens=64), 1
    )
    assert len(packed._micro_batches(samples)) == 1  # all six under the block-diagonal mask
    got = packed.compute_logprobs(samples)
    alone = [packed.compute_logprobs([s])[0] for s in samples]
    assert (flat(got) - flat(alone)).abs().max() < TOL


def test_an_engine_synced_from_it_gives_the_trainers_logprobs(folder, one_torch_thread):
    from treadle.rollout.engines.hf_engine import HFEngine

    samples = batch()
    backend = MegatronBackend(load_model(folder)[0], MEGA, 10)
    backend.train_step(samples, POLICY)
    engine = HFEngine(EngineSpec(model_dir=str(folder)))
    before = engine.prompt_logprobs([s.token_ids for s in samples])
    engine.update_weights(backend.named_weights(), version=1)
    got = engine.prompt_logprobs([s.token_ids for s in samples])
    trainer = backend.compute_logprobs(samples)
    assert (flat(got) - flat(trainer)).abs().max() < 1e-4
    assert (flat(before) - flat(trainer)).abs().max() > 1e-3  # the step moved them


def test_a_frozen_reference_scores_without_an_optimizer(folder, one_torch_thread):
    samples = batch()
    ref = MegatronBackend(load_model(folder)[0], MEGA, 1, trainable=False)
    assert not any(p.requires_grad for p in ref.model.parameters())
    want = TorchBackend(load_model(folder)[0], TORCH, 1, trainable=False)
    assert (
        flat(ref.compute_logprobs(samples)) - flat(want.compute_logprobs(samples))
    ).abs().max() < TOL
    with pytest.raises(RuntimeError, match="frozen"):
        ref.optimizer_state()


def test_refusals_name_the_key(folder):
    model = load_model(folder)[0]
    with pytest.raises(UserError, match=r"trainer\.megatron\.pipeline_parallel=2"):
        MegatronBackend(model, dataclasses.replace(MEGA, megatron=MegatronConfig(1, 2)), 1)
    with pytest.raises(UserError, match="critic"):
        MegatronBackend(model, MEGA, 1, head="value")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match=r"trainer\.bf16_autocast=false"):
            MegatronBackend(model, dataclasses.replace(MEGA, bf16_autocast=True), 1)
    with pytest.raises(UserError, match=r"trainer\.megatron\.tensor_parallel=2"):
        MegatronBackend(model, MEGA_TP2, 1)  # this process is one rank of tensor parallel 1


def _tp2_rank(rank: int, folder: str, init: str, out: str) -> None:
    """One of two TP ranks: the numbers :func:`expected` has, then a checkpoint's resume."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    samples, probe = batch(), batch(4)
    backend = MegatronBackend(load_model(folder)[0], MEGA_TP2, 10)
    got = {"logprobs": backend.compute_logprobs(samples), "entropy": entropies(backend, samples)}
    got |= step(backend, samples)
    got["logprobs_after"] = backend.compute_logprobs(samples)
    ckpt = Path(out).with_suffix(".ckpt")
    backend.save_pretrained(ckpt)
    state = copy.deepcopy(backend.optimizer_state())  # the whole model's moments, HF layout
    backend.train_step(samples, POLICY)
    resume_expected = backend.compute_logprobs(probe)
    dist.barrier()  # rank 0 has written the checkpoint
    saved = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    resumed = MegatronBackend(saved, MEGA_TP2, 10)
    resumed.load_optimizer_state(state)
    resumed.train_step(samples, POLICY)
    got["resume_diff"] = (flat(resumed.compute_logprobs(probe)) - flat(resume_expected)).abs()
    got["optimizer_state"] = (state.optimizer, state.scheduler)
    got["resume_expected"] = resume_expected
    if rank == 0:
        torch.save(got, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_over_two_processes_matches_the_torch_backend(folder, tmp_path, one_torch_thread):
    from treadle.rollout.engines.hf_engine import HFEngine

    out = tmp_path / "rank0.pt"
    mp.spawn(_tp2_rank, args=(str(folder), str(tmp_path / "init"), str(out)), nprocs=2)
    got = torch.load(out)
    check_against_torch(got, expected(folder))
    assert got["resume_diff"].max() < 1e-6
    # The TP-2 checkpoint resumes at tensor parallel 1 (this process) to the same next step:
    # the moments are saved in HF layout, which either size splits its own way.
    resumed = MegatronBackend(
        AutoModelForCausalLM.from_pretrained(out.with_suffix(".ckpt"), dtype=torch.float32),
        MEGA,
        10,
    )
    resumed.load_optimizer_state(OptimizerState(*got["optimizer_state"]))
    resumed.train_step(batch(), POLICY)
    diff = flat(resumed.compute_logprobs(batch(4))) - flat(got["resume_expected"])
    assert diff.abs().max() < 1e-5
    engine = HFEngine(EngineSpec(model_dir=str(folder)))
    engine.update_weights(got["weights"].items(), version=1)
    engine_lp = engine.prompt_logprobs([s.token_ids for s in batch()])
    assert (flat(engine_lp) - flat(got["logprobs_after"])).abs().max() < 1e-4


def test_the_sft_and_dpo_export_is_a_hugging_face_model(folder, tmp_path, one_torch_thread):
    """What `treadle sft`/`dpo` and the SFT warm-up write (``save_model_atomic`` of
    ``lora.exported(backend)``): the backend's own save, an HF folder whose weights are the
    trained ones (a GPTModel has no ``save_pretrained`` of its own)."""
    from treadle.store.atomic import save_model_atomic
    from treadle.train import lora

    backend = MegatronBackend(load_model(folder)[0], MEGA, 10)
    step(backend, batch())
    assert lora.exported(backend) is backend
    save_model_atomic(lora.exported(backend), load_model(folder)[1], tmp_path / "sft_model")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "sft_model").state_dict()
    weights = dict(backend.named_weights())
    assert all(torch.equal(saved[n], weights[n]) for n in saved)
