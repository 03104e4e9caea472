"""The training backend a trainer runs on (``trainer.backend``): one factory, so every job (RL's
policy, reference and critic, SFT, DPO, ``treadle inspect``) builds the same kind.

Each backend is a :class:`~treadle.train.torch_backend.TorchBackend` (the same objectives,
packing and micro-batch planning) whose optimizer, backward pass, gradient step, weights and
checkpoints are its own.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from transformers import PretrainedConfig, PreTrainedModel

from treadle.config import LoraConfig, TrainerConfig
from treadle.core.errors import UserError
from treadle.train.torch_backend import TorchBackend


def in_one_process(cfg: TrainerConfig) -> TrainerConfig:
    """``cfg`` as this process alone trains it: megatron at tensor parallel 1 (a Ray run's
    larger tensor-parallel group is its trainer ranks; the SFT warm-up and ``treadle inspect``'s
    replay run in the driver). The optimizer state is kept in a layout either size loads."""
    return dataclasses.replace(cfg, megatron=dataclasses.replace(cfg.megatron, tensor_parallel=1))


def build_backend(
    model: PreTrainedModel,
    cfg: TrainerConfig,
    total_steps: int,
    temperature: float = 1.0,
    trainable: bool = True,
    head: Literal["lm", "value"] = "lm",
) -> TorchBackend:
    """The ``cfg.backend`` trainer over ``model`` (arguments as :class:`TorchBackend`'s).

    ``deepspeed``: a trainable model gets a ZeRO engine
    (:class:`~treadle.train.deepspeed_backend.DeepSpeedBackend`); a frozen reference
    (``trainable=False``) has no optimizer to partition and stays a plain :class:`TorchBackend`,
    over bf16 weights under ``trainer.bf16_autocast`` as DeepSpeed's bf16 policy's (so a KL
    reference and the policy it starts as score alike).

    Raises:
        UserError: ``trainer.backend`` names a backend this installation cannot run.
    """
    if cfg.backend == "deepspeed" and not trainable and cfg.bf16_autocast:
        # the bf16 weights of DeepSpeed's bf16 policy (its parameters; buffers such as RoPE's
        # inv_freq stay fp32, as there): its twin at step 0, at half the size
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    if cfg.backend == "torch" or (cfg.backend == "deepspeed" and not trainable):
        return TorchBackend(model, cfg, total_steps, temperature, trainable, head)
    if cfg.backend == "megatron":
        from treadle.train.megatron_backend import MegatronBackend

        return MegatronBackend(model, cfg, total_steps, temperature, trainable, head)
    if cfg.backend == "deepspeed":
        from treadle.train.deepspeed_backend import DeepSpeedBackend  # imports deepspeed (~6 s)

        return DeepSpeedBackend(model, cfg, total_steps, temperature, head)
    raise UserError(
        f"config trainer.backend={cfg.backend}: not available; use trainer.backend=torch"
    )


def preflight(cfg: TrainerConfig, lora: LoraConfig, model_config: PretrainedConfig) -> None:
    """What building the trainer would refuse, checked on the model's config alone: before a
    run directory exists or minutes of SFT are spent (the same errors the build raises). The
    megatron backend's model family, RoPE, biases, tensor parallel size and bf16; DeepSpeed's
    CPU offload without CUDA; LoRA's target modules (on a weightless ``meta`` model).

    Raises:
        UserError: naming the config key and the fix.
    """
    if cfg.backend == "megatron":
        from treadle.train.megatron_backend import check_supported

        check_supported(model_config, cfg)
    if cfg.backend == "deepspeed":
        from treadle.train.deepspeed_backend import ds_config  # imports deepspeed (~6 s)

        ds_config(cfg)
    if lora.r:
        from transformers import AutoModelForCausalLM  # here: at the top it imports deepspeed

        from treadle.train.lora import check_targets

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config)
        check_targets(model, lora)
