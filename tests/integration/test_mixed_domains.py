"""A mixed-domain run (reasoning-gym + GSM8K + MBPP) through the real loop on a tiny model,
with per-domain metrics in its log. Needs ../shared/data (GSM8K, MBPP)."""

from __future__ import annotations

import io
import os

import pytest
from rich.console import Console

from treadle.config import load_config
from treadle.jobs.train import train

from .runs import REPO, TINY_RUN, is_finite_number, metric_rows

SHARED = REPO.parent / "shared" / "data"


@pytest.mark.skipif(
    not (SHARED / "gsm8k").exists() or not (SHARED / "mbpp").exists(),
    reason=f"needs {SHARED}/gsm8k and {SHARED}/mbpp (shared data, not part of the repo)",
)
def test_mixed_domain_run_logs_each_domain(tmp_path, one_torch_thread, monkeypatch):
    monkeypatch.chdir(REPO)  # the recipe's data paths are relative to the repository root
    tiny = [o for o in TINY_RUN if not o.startswith(("reward.", "data."))]
    overrides = [
        *tiny,
        f"run.output_dir={tmp_path}",
        "run.steps=2",
        "sft.steps=0",
        "eval.every=0",
        "eval.greedy=false",
        "data.size=24",
        "data.eval_size=4",
        "rollout.prompts_per_step=12",
        "rollout.max_tokens=16",
    ]
    cfg = load_config(REPO / "recipes" / "mixed.yaml", overrides)
    for source in cfg.data.mix:  # small GSM8K and MBPP slices (overrides address no list item)
        source.size, source.eval_size = 12, 4
    train(cfg, console=Console(file=io.StringIO()))
    rows = [r for r in metric_rows(tmp_path / "mixed") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    seen = set()
    for row in rows:
        for domain in ("arith", "math", "code"):
            if f"domain/{domain}/samples" in row:
                seen.add(domain)
                assert is_finite_number(row[f"domain/{domain}/reward"])
                assert 0 <= row[f"domain/{domain}/accuracy"] <= 1
    assert seen == {"arith", "math", "code"}
    assert os.path.exists(tmp_path / "mixed" / "final_model" / "config.json")
