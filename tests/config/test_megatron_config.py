"""The ``trainer.megatron`` section and what a run with ``trainer.backend=megatron`` refuses."""

from __future__ import annotations

import pytest

from treadle.config import load_config
from treadle.core.errors import UserError


def test_megatron_section_loads_from_overrides():
    cfg = load_config(None, ["trainer.backend=megatron", "trainer.megatron.tensor_parallel=1"])
    assert cfg.trainer.backend == "megatron"
    assert (cfg.trainer.megatron.tensor_parallel, cfg.trainer.megatron.pipeline_parallel) == (1, 1)


@pytest.mark.parametrize(
    "override",
    [
        "trainer.megatron.tensor_parallel=2",
        "trainer.megatron.pipeline_parallel=2",
        "placement.mode=colocated",
    ],
)
def test_a_run_refuses_what_one_process_cannot_hold(override):
    with pytest.raises(UserError, match=r"trainer\.backend=megatron .*use placement\.mode=single"):
        load_config(None, ["trainer.backend=megatron", override])


def test_a_run_refuses_a_megatron_critic():
    with pytest.raises(UserError, match=r"algorithm\.advantage=gae"):
        load_config(None, ["trainer.backend=megatron", "algorithm.advantage=gae"])


def test_a_run_refuses_gradient_checkpointing_under_megatron():
    with pytest.raises(UserError, match=r"^config trainer\.gradient_checkpointing=true: not wired"):
        load_config(None, ["trainer.backend=megatron", "trainer.gradient_checkpointing=true"])


def test_a_tensor_parallel_of_zero_names_the_key():
    with pytest.raises(UserError, match=r"trainer\.megatron\.tensor_parallel"):
        load_config(None, ["trainer.megatron.tensor_parallel=0"])
