"""A local Ray for the contract tests of the Ray implementations (trainer group, engine group,
Ray transports), started once for this package and stopped after it. Its logical CPUs are
accounting only (every worker runs one thread), so several placement groups fit at once."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="package")
def ray_cluster():
    if importlib.util.find_spec("ray") is None:
        pytest.skip("needs ray (scripts/install.sh installs it)")
    import ray

    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=True, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture
def placed(ray_cluster):
    """``placed(trainers, engines)``: a disaggregated placement group of that many one-CPU
    bundles, removed after the test."""
    from treadle.cluster.placement import place
    from treadle.config import PlacementConfig

    made = []

    def place_roles(trainers: int, engines: int):
        cfg = PlacementConfig(mode="disaggregated", trainers=trainers, engines=engines, threads=1)
        made.append(place(cfg))
        return cfg, made[-1]

    yield place_roles
    for placement in made:
        placement.remove()
