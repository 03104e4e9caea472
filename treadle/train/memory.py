"""Peak memory of a piece of work, measured the same way on a CPU and on a GPU.

On CUDA the allocator's own peak (``torch.cuda.max_memory_allocated``) is read. A CPU has no such
counter (the process's resident set moves with the allocator's caching and the OS), so there the
work runs under torch's profiler with ``profile_memory``, and its memory timeline (every tensor
storage created and destroyed, in order) is replayed to the highest sum of live bytes. Both count
the bytes of tensors allocated within the work and alive at the peak (activations, gradients,
temporaries), not what was allocated before it (the weights).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def peak_bytes(work: Callable[[], object], device: torch.device) -> int:
    """Bytes of tensor memory on ``device`` allocated by ``work()`` and alive at its peak (its
    result is dropped). On a CPU the profiler makes the work several times slower."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        work()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        work()
    live = peak = 0
    created = set()  # storages allocated within the work (a freed older one does not count)
    # _memory_profile: torch's own replay of the timeline (what export_memory_timeline plots)
    for _, action, (key, _), size in prof._memory_profile().timeline:
        if key.device.type != device.type:
            continue
        if action == Action.CREATE:
            created.add(key)
            live += size
        elif action == Action.DESTROY and key in created:
            live -= size
        peak = max(peak, live)
    return peak
