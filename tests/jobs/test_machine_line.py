"""The start-up ``machine:`` line (treadle/jobs/compose.py's for_this_machine): one line in a
log whatever its length, so it can be grepped, where rich's console would have hard-wrapped it
at 80 columns (the default width when output is not a terminal) mid-phrase."""

import io
from pathlib import Path

from rich.console import Console

from treadle.config import load_config
from treadle.jobs.compose import for_this_machine

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "default.yaml"


def test_the_machine_line_is_one_line_in_a_narrow_log(tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(file=out, width=40, force_terminal=False)
    cfg = load_config(RECIPE, ["rollout.engine=hf", "rollout.dtype=float32"])
    # an empty model folder: 0 parameters (nothing to read), the engine and dtype as given
    _, choice = for_this_machine(cfg, tmp_path, console, engine_here=True)
    text = out.getvalue()
    assert text == choice.describe() + "\n"
    assert len(text) > 40  # "machine: <cpu>, N cores, <isa> ...; engine hf, float32": over 40
    assert text.startswith("machine: ") and text.endswith("; engine hf, float32\n")
