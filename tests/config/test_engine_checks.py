"""``rollout.tensor_parallel`` and ``rollout.engine=sglang`` checked on load."""

from __future__ import annotations

import pytest

from treadle.config import load_config
from treadle.core.errors import UserError


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["rollout.tensor_parallel=0"], "config rollout.tensor_parallel"),
        (["rollout.engine=hf", "rollout.tensor_parallel=2"], "the hf engine runs one process"),
        (
            ["rollout.tensor_parallel=2", "placement.mode=disaggregated"],
            r"use placement.mode=single \(not disaggregated\)",
        ),
        (["rollout.engine=sglang", "rollout.mode=one_step_off"], "serves whole batches only"),
    ],
)
def test_engines_refuse_what_they_cannot_do(overrides, says):
    with pytest.raises(UserError, match=says):
        load_config(None, overrides)


def test_tensor_parallel_loads_for_vllm_and_sglang():
    assert load_config(None, []).rollout.tensor_parallel == 1
    for engine in ("vllm", "sglang", "mypkg.engines:Fast"):  # a plug-in reads the spec itself
        cfg = load_config(None, [f"rollout.engine={engine}", "rollout.tensor_parallel=2"])
        assert cfg.rollout.tensor_parallel == 2
