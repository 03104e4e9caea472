"""megatron-core 0.16.1 on a machine without CUDA: the three spots that call CUDA unconditionally,
redirected to the CPU (``install()``; a no-op wherever CUDA is available, where Megatron runs as
is).

1. The RNG tracker (``tensor_parallel.random``): ``model_parallel_cuda_manual_seed`` seeds and the
   tracker forks CUDA generators; dot-product attention forks the tracker around its dropout on
   every forward. Replaced by :class:`CpuRNGStatesTracker`, the same named states kept as CPU
   generator states, seeded by :func:`model_parallel_cpu_manual_seed` with Megatron's offsets.
2. ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` on its first
   call, and ``GlobalMemoryBuffer.get_tensor`` (attention's score buffer) allocates on
   ``torch.cuda.current_device()``: each is wrapped so that, during that call only,
   ``torch.cuda.current_device`` names the CPU (it would raise here otherwise).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

_INSTALLED = False


class CpuRNGStatesTracker:
    """Megatron's ``CudaRNGStatesTracker`` over the CPU generator: named RNG states, each
    forked into around the ops that must draw from it (e.g. dropout inside a tensor-parallel
    region, whose state differs per TP rank)."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        """Whether any state was added (Megatron's test before using the tracker)."""
        return bool(self.states_)

    def reset(self) -> None:
        """Forget every state."""
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the named states."""
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the named states (as :meth:`get_states` returned them)."""
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """A new state ``name`` seeded with ``seed`` (the default generator left as it was).

        Raises:
            Exception: ``seed`` or ``name`` was added before (as Megatron's tracker).
        """
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        """Draw from state ``name`` inside the block, then restore the default generator.

        Raises:
            Exception: ``name`` was never added.
        """
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def model_parallel_cpu_manual_seed(seed: int) -> None:
    """``model_parallel_cuda_manual_seed`` on the CPU generator: the default state gets
    ``seed``; the tracker's tensor-parallel state ``seed + 2718 + tp_rank`` and its expert state
    ``seed + 1024`` (Megatron's offsets, so dropout masks match a GPU run's layout of seeds).
    Call after ``parallel_state.initialize_model_parallel``."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random

    tracker = random._CUDA_RNG_STATE_TRACKER
    assert isinstance(tracker, CpuRNGStatesTracker), "megatron_cpu.install() first"
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker.add(random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)


@contextlib.contextmanager
def _current_device_is_cpu() -> Iterator[None]:
    """``torch.cuda.current_device()`` returns the CPU device inside the block (only entered
    where CUDA is absent, where the call would raise)."""
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = original


def _on_cpu(method: Callable) -> Callable:
    """``method`` run with :func:`_current_device_is_cpu`."""

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with _current_device_is_cpu():
            return method(*args, **kwargs)

    return wrapped


def install() -> None:
    """Redirect megatron-core's CUDA-only spots to the CPU, once per process; nothing where
    CUDA is available."""
    global _INSTALLED
    if _INSTALLED or torch.cuda.is_available():
        return
    from megatron.core import utils
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.tensor_parallel import random

    random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    rotary = rotary_pos_embedding.RotaryEmbedding
    rotary.__init__ = _on_cpu(rotary.__init__)  # without use_cpu_initialization it asks too
    rotary.get_emb = _on_cpu(rotary.get_emb)
    utils.GlobalMemoryBuffer.get_tensor = _on_cpu(utils.GlobalMemoryBuffer.get_tensor)
    _INSTALLED = True
