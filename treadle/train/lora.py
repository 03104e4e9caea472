"""LoRA (``model.lora.r > 0``, arXiv:2106.09685) through PEFT, for any training backend.

The policy model is wrapped by :func:`apply_lora` before its backend is built, so every
backend (``trainer.backend``) trains the same :class:`peft.PeftModel`: only the adapters'
``A [r, in]`` and ``B [out, r]`` require grad, so the optimizer holds only them. What leaves the
trainer is converted here, by pure functions of the state dict:

- :func:`merged_weights`: ``W' = W + (alpha / r) B A`` under the base model's Hugging Face
  names (``model.lora.sync=merged``, and the exported ``final_model``/``sft_model``);
- :func:`adapter_weights`: the adapter tensors only, in PEFT's file naming
  (``model.lora.sync=adapter``, served by vLLM's LoRA support).

The KL reference is the same model with its adapters disabled (:class:`AdapterDisabledReference`):
no second copy of the weights. A checkpoint's ``model/`` holds the adapter only (PEFT's
``save_pretrained``; its ``adapter_config.json`` names the base model folder).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from treadle.config import LoraConfig
from treadle.core.errors import UserError
from treadle.core.types import TrainSample

ADAPTER_DIRNAME = "adapter"
"""The adapter folder (PEFT format) inside an exported model folder."""
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.[^.]+\.weight$")
_BASE = re.compile(r"^(?P<module>.+)\.base_layer\.(?P<kind>weight|bias)$")
_PEFT_PREFIX = "base_model.model."


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (:func:`apply_lora`'s result)."""
    if "peft" not in sys.modules:  # nothing imported PEFT: no PEFT model exists (and no import)
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def linear_names(model: torch.nn.Module) -> list[str]:
    """The last name component of each ``nn.Linear`` in ``model``, sorted, without duplicates
    (what ``model.lora.target_modules`` may name)."""
    return sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )


def check_targets(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """``model.lora.target_modules`` against ``model`` (its weights may be on the ``meta``
    device: :func:`treadle.train.backends.preflight` checks before any work).

    Raises:
        UserError: a named module is no linear of the model (its linear modules are listed),
            or a tied ``lm_head`` is named.
    """
    if not isinstance(cfg.target_modules, list):
        return
    names = linear_names(model)
    missing = [t for t in cfg.target_modules if t not in names]
    if missing:
        raise UserError(
            f"config model.lora.target_modules: {missing} are not linear modules of this "
            f"model; its linear modules are {names} (or use 'all-linear')"
        )
    if "lm_head" in cfg.target_modules and getattr(model.config, "tie_word_embeddings", False):
        raise UserError(
            "config model.lora.target_modules: lm_head shares its weight with the input "
            "embedding in this model (tie_word_embeddings), so its adapter could not be "
            "merged into the one tensor engines and exports keep; leave lm_head out"
        )


def apply_lora(
    model: PreTrainedModel, cfg: LoraConfig, adapter: str | Path | None = None
) -> torch.nn.Module:
    """``model`` with fresh LoRA adapters per ``cfg`` (``B = 0``: the same outputs), or the
    adapter saved in folder ``adapter`` (trainable); only the adapters require grad.

    Raises:
        UserError: ``model.lora.target_modules`` names a module the model has no linear of
            (the model's linear names are listed) or a tied ``lm_head``, or the adapter folder
            does not load.
    """
    import peft

    check_targets(model, cfg)
    if adapter is not None:
        try:
            return peft.PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
        except (OSError, ValueError) as e:
            raise UserError(f"LoRA adapter {adapter}: cannot load it: {e}") from None
    config = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        target_modules=cfg.target_modules,
        lora_dropout=cfg.dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config)


def trainable_share(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters) of ``model``, each tensor counted once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def scaling(model: torch.nn.Module) -> float:
    """The active adapter's ``alpha / r`` (unitless)."""
    config = model.peft_config[model.active_adapter]
    return config.lora_alpha / config.r


def merged_weights(
    state: Mapping[str, torch.Tensor], scale: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """A PEFT model's state dict as the base model's Hugging Face weights, each adapted linear
    merged: ``W' = W + scale * B @ A`` (``W [out, in]``, ``B [out, r]``, ``A [r, in]``; fp32
    matmul, cast back to ``W``'s dtype). The ``base_model.model.`` prefix, ``base_layer`` and
    the ``lora_`` tensors disappear from the names.

    Raises:
        KeyError: a ``lora_A`` without its ``lora_B`` (or the reverse).
    """
    lora: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        if m := _LORA.match(name):
            lora.setdefault(m["module"], {})[m["ab"]] = tensor
    for name, tensor in state.items():
        if _LORA.match(name):
            continue
        hf = name.removeprefix(_PEFT_PREFIX)
        if m := _BASE.match(name):
            module = m["module"]
            hf = f"{module.removeprefix(_PEFT_PREFIX)}.{m['kind']}"
            if m["kind"] == "weight" and module in lora:
                a, b = lora[module]["A"], lora[module]["B"]
                delta = scale * (b.detach().float() @ a.detach().float())  # [out, in]
                tensor = (tensor.detach().float() + delta).to(tensor.dtype)
        yield hf, tensor.detach()


def adapter_weights(state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``lora_A``/``lora_B`` tensors of a PEFT model's state dict under the names PEFT
    writes to ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight``: the
    adapter's name dropped), which vLLM's LoRA loader reads."""
    for name, tensor in state.items():
        if m := _LORA.match(name):
            module = m["module"]
            if not module.startswith(_PEFT_PREFIX):
                module = _PEFT_PREFIX + module
            yield f"{module}.lora_{m['ab']}.weight", tensor.detach()


def adapter_config_json(model: torch.nn.Module) -> str:
    """The active adapter's ``adapter_config.json`` text (what an engine loading the adapter
    tensors of :func:`adapter_weights` needs beside them)."""
    config = model.peft_config[model.active_adapter].to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    config.pop("runtime_config", None)
    return json.dumps(config, default=str)


class MergedExport:
    """A PEFT model saved as users load a model: merged Hugging Face weights (and config) in
    the folder, its adapter (PEFT format) in ``folder/adapter``. A
    :class:`~treadle.core.protocols.PretrainedSaver`.

    Args:
        model: the PEFT model (the backend's, or one being trained by SFT/DPO).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def save_pretrained(self, folder: Path) -> None:
        """Write the merged model to ``folder`` and the adapter to ``folder/adapter``."""
        base = self.model.get_base_model()
        merged = dict(merged_weights(self.model.state_dict(), scaling(self.model)))
        tied = getattr(base.config, "tie_word_embeddings", False)
        if tied:  # one tensor, saved under the embedding's name
            merged.pop("lm_head.weight", None)
        plain = type(base)(base.config)  # the architecture without adapters, weights from merged
        plain.load_state_dict(merged, strict=not tied)
        plain.save_pretrained(folder)
        self.model.save_pretrained(Path(folder) / ADAPTER_DIRNAME)


def exported(backend):
    """What to save of a trained ``backend`` (a ``TrainingBackend``) as a Hugging Face folder:
    a PEFT model merged (:class:`MergedExport`), else the backend itself, whose
    ``save_pretrained`` writes full Hugging Face weights whatever it holds (ZeRO-3's partitions
    gathered, Megatron's layout converted back)."""
    return MergedExport(backend.model) if is_lora(backend.model) else backend


def engine_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What an engine loads as the model's full weights: its state dict, merged
    (:func:`merged_weights`) when it is a PEFT model."""
    state = model.state_dict()
    if is_lora(model):
        return merged_weights(state, scaling(model))
    return ((n, t.detach()) for n, t in state.items())


class AdapterDisabledReference:
    """The frozen reference policy of a LoRA policy: the policy's own backend with its
    adapters disabled (``PeftModel.disable_adapter``), i.e. the base model; no second copy of
    the weights. Used wherever a frozen backend's ``compute_logprobs`` is (the KL reference,
    DPO's reference).

    Args:
        policy: the LoRA policy's backend (its ``model`` a PEFT model).
    """

    def __init__(self, policy) -> None:
        self.policy = policy

    def compute_logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Per-token logprobs ``[L]`` (nats) of each sample under the base weights (the
        policy's forward path: same packing, same temperature)."""
        with self.policy.model.disable_adapter():
            return self.policy.compute_logprobs(samples)


def adapter_bytes(named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Bytes of the tensors of ``named`` (what one sync sends)."""
    return sum(t.numel() * t.element_size() for _, t in named)
