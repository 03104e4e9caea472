"""The LoRA adapter a vLLM engine serves over its base model (``model.lora.sync=adapter``).

vLLM loads adapters from PEFT folders: each weight update is written as one
(``adapter_model.safetensors`` + ``adapter_config.json``, a few MB where the full model is GB)
into this engine's temporary folder and registered as a new ``LoRARequest`` (a fresh int id per
update, so no cached copy of an older adapter can be served); the previous one is removed
from vLLM and from disk.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from vllm.lora.request import LoRARequest

# vLLM's allowed ``max_lora_rank`` values (``vllm.config.lora.MaxLoRARanks``).
_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class AdapterSlot:
    """The adapter being served, and how vLLM must be started to serve one.

    Args:
        config_json: the adapter's ``adapter_config.json`` text (PEFT; its ``r`` sizes vLLM's
            LoRA buffers).

    Raises:
        ValueError: the rank is above vLLM's largest (512).
    """

    def __init__(self, config_json: str) -> None:
        self._config = config_json
        rank = int(json.loads(config_json)["r"])
        fits = [r for r in _RANKS if r >= rank]
        if not fits:
            raise ValueError(f"LoRA rank {rank}: vLLM serves ranks up to {_RANKS[-1]}")
        self.max_rank = fits[0]
        self.request: LoRARequest | None = None
        """What each request is generated with; None: the base model alone (before the first
        update, when the adapter's B is 0 and base + adapter = base)."""
        self._root = Path(tempfile.mkdtemp(prefix="treadle-lora-"))
        self._next_id = 1

    def engine_kwargs(self) -> dict[str, object]:
        """``vllm.LLM``'s LoRA arguments: one adapter at a time, of up to ``max_rank``."""
        return {"enable_lora": True, "max_lora_rank": self.max_rank, "max_loras": 1}

    def update(self, llm, tensors: dict[str, torch.Tensor]) -> None:
        """Serve the adapter of ``tensors`` (PEFT's file names, ``...lora_A.weight``) from the
        next request on, through ``llm`` (a ``vllm.LLM``)."""
        folder = self._root / f"adapter_{self._next_id}"
        folder.mkdir()
        save_file(
            {n: t.contiguous() for n, t in tensors.items()}, folder / "adapter_model.safetensors"
        )
        (folder / "adapter_config.json").write_text(self._config, encoding="utf-8")
        old, self.request = (
            self.request,
            LoRARequest(f"policy_{self._next_id}", self._next_id, str(folder)),
        )
        self._next_id += 1
        if old is not None:
            self.drop(llm, old)

    def drop(self, llm, request: LoRARequest | None = None) -> None:
        """Stop serving ``request`` (default: the current adapter, leaving the base model)."""
        request = request or self.request
        if request is None:
            return
        if request is self.request:
            self.request = None
        llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def close(self) -> None:
        """Delete the adapter folders."""
        shutil.rmtree(self._root, ignore_errors=True)
