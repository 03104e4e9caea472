"""Shared fixtures of the contract tests: the engines' tiny model and its trainer, and a local
Ray for the contract tests of the Ray implementations (trainer group, engine group, Ray
transports), started once for this package and stopped after it. Its logical CPUs are
accounting only (every worker runs one thread), so several placement groups fit at once."""

from __future__ import annotations

import importlib.util

import pytest
from integration.tiny import build_tiny_folder

from treadle.config import TrainerConfig
from treadle.store.models import load_model
from treadle.train.torch_backend import TorchBackend


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory):
    """The engine contracts' tiny model, given a few SFT steps first so that it really ends its
    turn with ``<|im_end|>`` (a random model almost never samples the end-of-turn token, and the
    STOP half of the finish-reason contract would go untested)."""
    folder = tmp_path_factory.mktemp("contract") / "model"
    build_tiny_folder(folder, sft_steps=40)
    return folder


@pytest.fixture(scope="package")
def tokenizer_and_trainer(model_dir):
    """The model's tokenizer and a trainer over it (its logprobs are the reference)."""
    model, tokenizer = load_model(model_dir)
    return tokenizer, TorchBackend(model, TrainerConfig(), total_steps=1)


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
