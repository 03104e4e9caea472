"""One Ray placement group sliced into roles: trainer workers and engine workers.

``disaggregated``: bundles ``[trainer] * T + [engine] * E``, each worker alone in its bundle.
``colocated``: bundles ``[trainer + engine] * T``; trainer ``i`` and engine ``i`` (``i < E``) share
bundle ``i``, so on a GPU cluster they share a GPU. The same code asks for CPU bundles here and
GPU bundles on a GPU cluster; only the numbers in ``placement.*`` change.

On one machine with no Ray running, :func:`start_ray` starts a local Ray whose logical CPU count
covers the bundles (logical CPUs are accounting: the workers' real threads are set by
``placement.threads``).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from treadle.config import PlacementConfig
from treadle.core.errors import UserError


@dataclass(frozen=True)
class Slot:
    """Where one worker goes: its bundle and the share of the bundle it asks for."""

    bundle: int
    cpus: float
    gpus: float


@dataclass
class Placement:
    """The placement group and each role's slots."""

    group: object
    """The ``ray.util.placement_group.PlacementGroup``."""
    trainers: list[Slot]
    engines: list[Slot]

    def options(self, slot: Slot) -> dict:
        """``actor_cls.options(**...)`` arguments that pin an actor to ``slot``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_cpus": slot.cpus,
            "num_gpus": slot.gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=slot.bundle
            ),
        }

    def remove(self) -> None:
        """Release the placement group's reserved resources back to Ray."""
        from ray.util import remove_placement_group

        remove_placement_group(self.group)


def bundles(cfg: PlacementConfig) -> tuple[list[dict[str, float]], list[Slot], list[Slot]]:
    """The bundle specs and the trainer and engine slots of ``cfg`` (pure: no Ray needed)."""
    trainer = {"CPU": cfg.trainer_cpus, "GPU": cfg.trainer_gpus}
    engine = {"CPU": cfg.engine_cpus, "GPU": cfg.engine_gpus}
    if cfg.mode == "disaggregated":
        specs = [trainer] * cfg.trainers + [engine] * cfg.engines
        t = [Slot(i, cfg.trainer_cpus, cfg.trainer_gpus) for i in range(cfg.trainers)]
        e = [Slot(cfg.trainers + j, cfg.engine_cpus, cfg.engine_gpus) for j in range(cfg.engines)]
    elif cfg.mode == "colocated":
        specs = [
            {k: trainer[k] + (engine[k] if i < cfg.engines else 0.0) for k in trainer}
            for i in range(cfg.trainers)
        ]
        t = [Slot(i, cfg.trainer_cpus, cfg.trainer_gpus) for i in range(cfg.trainers)]
        e = [Slot(j, cfg.engine_cpus, cfg.engine_gpus) for j in range(cfg.engines)]
    else:
        raise ValueError(f"placement.mode {cfg.mode!r} has no bundles")
    specs = [{k: v for k, v in spec.items() if v > 0} or {"CPU": 0.01} for spec in specs]
    return specs, t, e


def start_ray(cfg: PlacementConfig) -> None:
    """Connect to a running Ray (``RAY_ADDRESS``) or start a local one sized to the bundles."""
    import ray

    if ray.is_initialized():
        return
    specs, _, _ = bundles(cfg)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return
    cpus = sum(s.get("CPU", 0.0) for s in specs)
    gpus = sum(s.get("GPU", 0.0) for s in specs)
    ray.init(
        num_cpus=max(int(cpus + 0.999) + 1, os.cpu_count() or 1),
        num_gpus=int(gpus + 0.999) if gpus else None,
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
    )


def place(cfg: PlacementConfig, timeout_s: float = 120.0) -> Placement:
    """Reserve the placement group of ``cfg`` and return the roles' slots.

    Raises:
        UserError: the cluster cannot hold the bundles within ``timeout_s`` (the message gives
            what was asked for).
    """
    import ray
    from ray.util.placement_group import placement_group

    specs, trainers, engines = bundles(cfg)
    start_ray(cfg)
    group = placement_group(specs, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise UserError(
            f"placement: Ray could not reserve bundles {specs} within {timeout_s:.0f} s "
            f"(cluster resources: {ray.cluster_resources()}); lower placement.*_cpus/_gpus"
        ) from None
    return Placement(group, trainers, engines)


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
