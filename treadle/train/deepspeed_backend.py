"""DeepSpeed ZeRO training backend (``trainer.backend=deepspeed``, ``trainer.deepspeed``).

A :class:`~treadle.train.torch_backend.TorchBackend` (the same objectives, packing, micro-batch
planning and loss denominators) whose AdamW, LR schedule, gradient clipping and step run in a
DeepSpeed engine with ZeRO stage 1, 2 or 3 (Rajbhandari et al. 2020, arXiv:1910.02054):

- the AdamW and ``LambdaLR`` are :class:`TorchBackend`'s own (``trainer.lr/betas/weight_decay``,
  :func:`~treadle.train.torch_backend.lr_lambda`), handed to ``deepspeed.initialize``, which
  steps them on its fp32 partitions; ``trainer.grad_clip`` is DeepSpeed's
  ``gradient_clipping`` (the same ``max_norm / (norm + 1e-6)`` factor as torch's);
- gradient accumulation stays treadle's: ``managed_gradient_accumulation: false`` and
  ``backward(loss, scale_wrt_gas=False)``, so every micro-batch's loss keeps the step-wide
  denominator :meth:`TorchBackend.optimizer_step` gives it and ``engine.step()`` (one per
  optimizer step, :meth:`apply_gradients`) is the accumulation boundary;
- ``trainer.bf16_autocast``: DeepSpeed's bf16 mode (weights and gradients bf16, fp32 master
  weights and moments in the ZeRO optimizer, the micro-batches' gradients accumulated and
  reduced over ranks in fp32: ``data_types.grad_accum_dtype``, ``communication_data_type``;
  the frozen KL reference holds the same bf16 weights,
  :func:`~treadle.train.backends.build_backend`); :meth:`named_weights` and checkpoints are the
  fp32 masters, so a resumed run starts from exactly the weights the run had;
- :meth:`optimizer_state` is GATHERED into ``torch.optim.AdamW.state_dict()``'s layout (one
  entry per parameter, in ``model.parameters()`` order: ``step``, ``exp_avg``, ``exp_avg_sq``,
  full shapes), not DeepSpeed's per-rank partitions, so treadle's checkpoints
  (:mod:`treadle.store.checkpoint`, loaded with ``weights_only=True``) hold the same thing
  for either backend; under ZeRO-3 every rank must call it (it all-gathers).

One process (``placement.mode=single``) starts a world-1 ``gloo`` process group on a free
local port when none exists (``nccl`` with CUDA); ranks of a larger group call it after their
own ``init_process_group``. Without CUDA ``DS_ACCELERATOR=cpu`` is set before DeepSpeed is
imported (the CPU accelerator; its communication backend is gloo unless oneCCL's torch
bindings are installed).

The shared-memory comm op: constructing DeepSpeed's communication backend
(``deepspeed.comm.torch.TorchBackend.__init__``, run once per process by
``deepspeed.initialize``/``init_distributed``, whether or not torch.distributed is already
initialised) calls ``build_shm_op()``, which on the CPU accelerator JIT-compiles
``deepspeed_shm_comm_op`` (``ops/op_builder/cpu/comm.py`` ``ShareMemCommBuilder``, ninja and
gcc, ~5 minutes, cached in ``TORCH_EXTENSIONS_DIR``) whenever
``deepspeed.ops.__compatible_ops__`` marks it compatible (Linux with a compiler). Its only user
is ``inference_all_reduce`` (DeepSpeed-Inference tensor parallelism); ZeRO training's
all-reduce, reduce-scatter and all-gather are plain ``torch.distributed`` calls on gloo. So this
module marks the op incompatible in that cache (``deepspeed/ops/__init__.py``: "edits to it
persist") before DeepSpeed's backend is built. Checked here: without it, a bare
``deepspeed.init_distributed`` on an empty ``TORCH_EXTENSIONS_DIR`` starts ``ninja`` on
``deepspeed_shm_comm``; with it the folder stays empty and DeepSpeed's part of the start-up is
its import (~6 s) and ``deepspeed.initialize`` (0.1-1 s for the tiny model). The 2-rank test of
tests/train/test_deepspeed_backend.py checks the folder stays empty in fresh processes.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import PreTrainedModel

from treadle.config import TrainerConfig
from treadle.core.errors import UserError
from treadle.core.protocols import OptimizerState
from treadle.train import lora
from treadle.train.torch_backend import TorchBackend

SHM_COMM_OP = "deepspeed_shm_comm"
"""``ShareMemCommBuilder.NAME``: the op this module keeps DeepSpeed from compiling."""


def import_deepspeed():
    """``deepspeed``, imported with ``DS_ACCELERATOR=cpu`` when there is no CUDA device (unless
    the caller set it) and its shared-memory comm op marked unbuildable (module docstring)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False  # probed once, then cached; ~0.2 s
    return deepspeed


def init_single_process_group() -> None:
    """A world-1 process group (gloo; nccl with CUDA) on a free 127.0.0.1 port, unless one is
    initialised already: a rank of a larger group (which sets ``LOCAL_RANK`` itself), or the
    world-1 group an in-process vLLM engine started first (resumed runs, ``sft.steps=0``), which
    ZeRO then uses.

    Sets ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` (DeepSpeed's
    engine asserts ``LOCAL_RANK`` is set)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() == 1:
            os.environ.setdefault("LOCAL_RANK", "0")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    os.environ.update(env | {"LOCAL_RANK": "0"})
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)


def _forget_destroyed_groups() -> None:
    """Drop DeepSpeed's cached world and data-parallel groups when their process group has been
    destroyed since (an in-process vLLM engine's shutdown destroys the world-1 group, and a
    later backend would broadcast over the dead one: "Group ... is not registered")."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    live = dist.distributed_c10d._world.pg_group_ranks
    for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP"):
        group = getattr(groups, name)
        if group is not None and group not in live:
            setattr(groups, name, None)


def ds_config(cfg: TrainerConfig, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config of ``cfg`` (``extra`` merged into it, one level deep per section).

    Raises:
        UserError: ``trainer.deepspeed.offload_optimizer`` without a CUDA device.
    """
    zero: dict[str, Any] = {"stage": cfg.deepspeed.zero_stage}
    if cfg.deepspeed.offload_optimizer:
        if not torch.cuda.is_available():
            raise UserError(
                "config trainer.deepspeed.offload_optimizer=true: there is no CUDA device, so "
                "the optimizer state is in CPU memory already; set it to false"
            )
        zero["offload_optimizer"] = {"device": "cpu"}
    out: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,  # treadle packs its own micro-batches
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # engine.step() is the boundary
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.bf16_autocast},
        # bf16 gradients of the micro-batches add up in fp32 (DeepSpeed's default is the model
        # dtype: a micro-batch's gradient under 1/512 of the running sum is lost; ZeRO-1 then
        # runs as DeepSpeed's BF16_Optimizer), and the ranks' sums are reduced in fp32 (ZeRO-1
        # would reduce them in bf16)
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32",
        "zero_allow_untested_optimizer": True,  # torch's AdamW
        "zero_force_ds_cpu_optimizer": False,  # offload with torch's AdamW, no cpu_adam build
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    for key, value in (extra or {}).items():
        out[key] = out[key] | value if isinstance(value, dict) and key in out else value
    return out


def bucket_sizes(hidden: int) -> dict[str, int]:
    """ZeRO's communication buffers sized to the model (elements), as the transformers
    integration's ``"auto"`` values: DeepSpeed's defaults (5e8 elements for the reduce and
    all-gather buckets) allocate 2 GB fp32 buffers even for a tiny model (measured: 1.9 GiB
    of the step's peak under ZeRO-1/2, held under ZeRO-3; ``bench/backend_step.py``)."""
    square = hidden * hidden
    return {
        "reduce_bucket_size": square,
        "allgather_bucket_size": square,
        "stage3_prefetch_bucket_size": int(0.9 * square),
        "stage3_param_persistence_threshold": 10 * hidden,
    }


class DeepSpeedBackend(TorchBackend):
    """A trainable model under a DeepSpeed ZeRO engine (module docstring). A frozen reference
    (``trainable=False``) has no optimizer to partition:
    :func:`treadle.train.backends.build_backend` builds a plain :class:`TorchBackend` for it.

    Args:
        model, cfg, total_steps, temperature, head: as :class:`TorchBackend`'s.
        ds_extra: DeepSpeed config entries merged over :func:`ds_config`'s and
            :func:`bucket_sizes` (tests: e.g.
            ``{"zero_optimization": {"stage3_param_persistence_threshold": 0}}``).

    Raises:
        UserError: ``trainer.deepspeed.offload_optimizer`` without CUDA.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        cfg: TrainerConfig,
        total_steps: int,
        temperature: float = 1.0,
        head: Literal["lm", "value"] = "lm",
        ds_extra: dict[str, Any] | None = None,
    ):
        extra = dict(ds_extra or {})
        zero = extra.get("zero_optimization", {})
        extra["zero_optimization"] = bucket_sizes(model.config.hidden_size) | zero
        config = ds_config(cfg, extra)
        deepspeed = import_deepspeed()
        self.engine = None  # the packing probe runs on the bare model
        super().__init__(model, cfg, total_steps, temperature, True, head)
        # the optimizer state's order (torch's AdamW's: the trainable ones, all but a LoRA
        # model's frozen base weights); every parameter is gathered for the weights
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._all = list(model.parameters())
        masters = [p.detach().clone() for p in self._params] if cfg.bf16_autocast else None
        init_single_process_group()
        _forget_destroyed_groups()
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=self.optimizer, lr_scheduler=self.scheduler, config=config
        )
        self.device = self.engine.device
        self._stage3 = cfg.deepspeed.zero_stage == 3
        if masters is not None:  # bf16: the fp32 masters are the given weights, not bf16's
            from deepspeed.utils import safe_set_full_fp32_param

            for p, master in zip(self._params, masters, strict=True):
                safe_set_full_fp32_param(p, master.to(self.device))

    def _forward_module(self) -> torch.nn.Module:
        """``engine.forward`` once the engine exists (the packing probe runs on the bare model):
        it starts ZeRO's bookkeeping of each micro-batch (without it ZeRO-3 overwrites, instead
        of adding to, the gradients of the micro-batches before the last)."""
        return self.model if self.engine is None else self.engine

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate a micro-batch's gradients through the engine (no 1/steps scaling: the
        loss carries the step-wide denominator already)."""
        self.engine.backward(loss, scale_wrt_gas=False)

    def apply_gradients(self) -> tuple[float, float]:
        """``engine.step()``: reduce the accumulated gradients, clip to ``cfg.grad_clip``, one
        AdamW and LR-schedule step; returns the pre-clip global grad norm and the LR applied."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm if norm is not None else float("nan")), lr

    def _full(self, get, p: torch.nn.Parameter, *key: str) -> torch.Tensor:
        """``get(p, *key)`` (a ``deepspeed.utils.safe_get_full_*``) in ``p``'s full shape, on
        the CPU."""
        shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
        return get(p, *key).detach().reshape(shape).cpu().clone()

    def _state(self) -> list[tuple[str, torch.Tensor]]:
        """The module's full state dict (ZeRO-3's shards gathered; under bf16 the fp32 masters
        of what trains), each a detached copy (tied weights under each of their names). Under
        ZeRO-3 every rank must call it (it all-gathers)."""
        from deepspeed import zero
        from deepspeed.utils import safe_get_full_fp32_param

        copies: dict[int, torch.Tensor] = {}  # one copy per tensor: tied names share it
        if self.cfg.bf16_autocast:
            copies = {id(p): self._full(safe_get_full_fp32_param, p) for p in self._params}
        with zero.GatheredParameters(self._all, enabled=self._stage3):
            weights = [
                (n, copies.setdefault(id(t), t.detach().clone()))
                for n, t in self.model.state_dict(keep_vars=True).items()
            ]
        return weights

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What an engine loads: :meth:`_state`, a LoRA model's merged into its base model's
        names (:func:`treadle.train.lora.merged_weights`). Under ZeRO-3 every rank must call
        it."""
        weights = self._state()
        if lora.is_lora(self.model):
            yield from lora.merged_weights(dict(weights), lora.scaling(self.model))
        else:
            yield from weights

    def save_pretrained(self, folder: Path) -> None:
        """The full model (fp32 masters under bf16) in Hugging Face format, a LoRA model's
        adapter only (PEFT format), written by rank 0 (every rank must call it under ZeRO-3 or
        bf16)."""
        import torch.distributed as dist

        weights = dict(self._state())  # a LoRA model's PEFT save keeps its adapter's entries
        if dist.get_rank() == 0:
            self.model.save_pretrained(folder, state_dict=weights)

    def optimizer_state(self) -> OptimizerState:
        """The AdamW state gathered into ``torch.optim.AdamW.state_dict()``'s layout (module
        docstring) and the LR schedule's state dict; every rank gets the whole of it."""
        from deepspeed.utils import safe_get_full_optimizer_state

        inner = self.optimizer.optimizer  # torch's AdamW over the fp32 partitions
        assert len(inner.param_groups) == 1, "one parameter group, as TorchBackend's"
        steps = {float(s["step"]) for s in inner.state.values()}
        state = {}
        if steps:  # before the first step the state is empty, as torch's
            (step,) = steps
            for i, p in enumerate(self._params):
                state[i] = {"step": torch.tensor(step)} | {
                    key: self._full(safe_get_full_optimizer_state, p, key)
                    for key in ("exp_avg", "exp_avg_sq")
                }
        group = {k: v for k, v in inner.param_groups[0].items() if k != "params"}
        groups = [group | {"params": list(range(len(self._params)))}]
        return OptimizerState({"state": state, "param_groups": groups}, self.scheduler.state_dict())

    def load_optimizer_state(self, state: OptimizerState) -> None:
        """Restore :meth:`optimizer_state`'s result (or a :class:`TorchBackend`'s over the same
        model) into the partitions this rank holds.

        Raises:
            KeyError, ValueError: the state was saved for another model or optimizer, or
                without a schedule.
        """
        from deepspeed.utils import safe_set_full_optimizer_state

        saved, inner = state.optimizer, self.optimizer.optimizer
        (group,) = saved["param_groups"]
        if len(group["params"]) != len(self._params):
            raise ValueError(
                f"the state is of another model: {len(group['params'])} parameters, "
                f"{len(self._params)} here"
            )
        if state.scheduler is None:
            raise ValueError("the state was saved without an lr scheduler")
        if saved["state"]:
            step = float(saved["state"][group["params"][0]]["step"])
            # the fp32 partitions torch's AdamW steps (it creates their state lazily)
            flats = self.optimizer.fp32_partitioned_groups_flat if self._stage3 else None
            for flat in flats or inner.param_groups[0]["params"]:
                # A state stepped already is reset in place: ZeRO-1/2 link each parameter's
                # fragment to these very tensors once, so fresh ones would be left unwritten.
                moments = inner.state.get(flat) or {
                    "exp_avg": torch.zeros_like(flat),
                    "exp_avg_sq": torch.zeros_like(flat),
                }
                moments["exp_avg"].zero_()
                moments["exp_avg_sq"].zero_()
                inner.state[flat] = moments | {"step": torch.tensor(step)}
            if not self._stage3:  # ZeRO-1/2 link the parameters to it after a first step
                self.optimizer._lazy_init_hp_params_optimizer_state()
            for index, p in zip(group["params"], self._params, strict=True):
                shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
                for key in ("exp_avg", "exp_avg_sq"):
                    value = saved["state"][index][key]
                    if value.shape != shape:
                        raise ValueError(f"{key} of parameter {index}: {value.shape} != {shape}")
                    safe_set_full_optimizer_state(p, value.to(self.device), key)
        inner.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        self.scheduler.load_state_dict(state.scheduler)
