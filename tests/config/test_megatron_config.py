"""The ``trainer.megatron`` section and what a run with ``trainer.backend=megatron`` refuses."""

from __future__ import annotations

import dataclasses
import re

import pytest

from treadle.config import load_config
from treadle.core.errors import UserError


def test_megatron_section_loads_from_overrides():
    cfg = load_config(None, ["trainer.backend=megatron", "trainer.megatron.tensor_parallel=1"])
    assert cfg.trainer.backend == "megatron"
    assert (cfg.trainer.megatron.tensor_parallel, cfg.trainer.megatron.pipeline_parallel) == (1, 1)


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        # one process holds tensor parallel 1 only: the fix names the Ray group of 2 ranks
        (
            ["trainer.megatron.tensor_parallel=2"],
            r"use placement\.mode=disaggregated \(or colocated\) with placement\.trainers=2$",
        ),
        # two Ray ranks are one TP group of 2 (no data parallelism over Megatron ranks)
        (
            ["placement.mode=colocated", "placement.trainers=2", "placement.engines=1"],
            r"use trainer\.megatron\.tensor_parallel=2$",
        ),
        (
            [
                "placement.mode=disaggregated",
                "placement.trainers=4",
                "trainer.megatron.tensor_parallel=2",
            ],
            r"\(4 rank\(s\) .*use trainer\.megatron\.tensor_parallel=4$",
        ),
    ],
)
def test_a_tensor_parallel_size_other_than_the_ranks_is_refused(overrides, fix):
    with pytest.raises(UserError, match=r"^config trainer\.megatron\.tensor_parallel=\d: ") as e:
        load_config(None, ["trainer.backend=megatron", *overrides])
    assert re.search(fix, str(e.value)) and "\n" not in str(e.value)


def test_tensor_parallel_over_the_ray_ranks_loads():
    overrides = ["trainer.megatron.tensor_parallel=2", "placement.mode=disaggregated"]
    cfg = load_config(None, ["trainer.backend=megatron", *overrides, "placement.trainers=2"])
    assert (cfg.placement.trainers, cfg.trainer.megatron.tensor_parallel) == (2, 2)


def test_pipeline_parallelism_is_refused():
    with pytest.raises(UserError, match=r"^config trainer\.megatron\.pipeline_parallel=2: .*=1$"):
        load_config(None, ["trainer.backend=megatron", "trainer.megatron.pipeline_parallel=2"])


def test_a_run_refuses_a_megatron_critic():
    with pytest.raises(UserError, match=r"algorithm\.advantage=gae"):
        load_config(None, ["trainer.backend=megatron", "algorithm.advantage=gae"])


def test_a_run_refuses_gradient_checkpointing_under_megatron():
    with pytest.raises(UserError, match=r"^config trainer\.gradient_checkpointing=true: not wired"):
        load_config(None, ["trainer.backend=megatron", "trainer.gradient_checkpointing=true"])


def test_a_tensor_parallel_of_zero_names_the_key():
    with pytest.raises(UserError, match=r"trainer\.megatron\.tensor_parallel"):
        load_config(None, ["trainer.megatron.tensor_parallel=0"])


def test_the_driver_trains_a_ray_runs_megatron_at_tensor_parallel_1():
    """The SFT warm-up and `treadle inspect`'s replay run in the driver process, which alone is
    tensor parallel 1; everything else of the trainer config is kept."""
    from treadle.train.backends import in_one_process

    overrides = ["trainer.megatron.tensor_parallel=2", "placement.mode=disaggregated"]
    cfg = load_config(None, ["trainer.backend=megatron", *overrides, "placement.trainers=2"])
    alone = in_one_process(cfg.trainer)
    assert alone.megatron.tensor_parallel == 1 and cfg.trainer.megatron.tensor_parallel == 2
    assert dataclasses.replace(alone, megatron=cfg.trainer.megatron) == cfg.trainer
