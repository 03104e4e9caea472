"""Driver for a test: ``python record_prompts.py RECIPE OUT.json`` runs ``treadle.jobs.train.train``
on RECIPE and writes the prompt token ids the RL loop's rollouts sent to the engine into OUT.json
(it wraps the ``generate`` that :mod:`treadle.jobs.sources` calls for a ``sync`` batch).

Imports stay inside ``main``: reward workers are spawned and re-import this file.
"""

from __future__ import annotations


def main() -> None:
    import json
    import sys
    from pathlib import Path

    import treadle.jobs.sources as sources
    from treadle.config import load_config
    from treadle.jobs.train import train

    recorded: list[dict] = []
    original = sources.generate

    def recording(engine, tokenizer, tasks, params, template_kwargs=None):
        out = original(engine, tokenizer, tasks, params, template_kwargs)
        recorded.extend(
            {"question": g.task.messages[-1].content, "prompt_token_ids": list(g.prompt_token_ids)}
            for g in out
        )
        return out

    sources.generate = recording
    train(load_config(sys.argv[1]))
    Path(sys.argv[2]).write_text(json.dumps(recorded))


if __name__ == "__main__":
    main()
