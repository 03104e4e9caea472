"""``treadle eval --output``: what it refuses to write over, in one line before any work."""

from __future__ import annotations

from pathlib import Path

from treadle.cli import main

DEFAULT = Path(__file__).resolve().parents[2] / "recipes" / "default.yaml"


def test_an_output_that_is_a_file_is_refused_even_with_overwrite(tmp_path, capsys):
    # --overwrite replaced an earlier evaluation's folder; given a file it moved the file aside,
    # renamed the new folder in, then died in rmtree (NotADirectoryError, exit 1), leaving
    # .tmp_old_notes.txt behind. The user's file is theirs: refused, untouched, nothing written.
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "qwen2"}')
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    args = ["eval", str(tmp_path / "m"), str(DEFAULT), "--output", str(notes), "--overwrite"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == f"treadle: error: treadle eval: --output {notes} is a file, not a folder; " \
        "pass --output DIR for a folder the evaluation may write\n"  # fmt: skip
    assert notes.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "notes.txt"]
