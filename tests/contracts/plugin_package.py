"""A user's own package, as a recipe names it (``userplug.rewards:ContainsGold``), written to a
temporary folder by the plug-in tests: reward functions (a class and plain functions), a data
loader, an engine wrapping the fake one, and the broken variants whose one-line errors the tests
check."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

PACKAGE = "userplug"

FILES = {
    "__init__.py": "",
    "rewards.py": '''
        from treadle.rewards import Score


        class ContainsGold:
            """1 + bonus when the gold answer appears in the completion, else 0."""

            name = "contains_gold"

            def __init__(self, bonus: float = 0.0, strict: bool = False) -> None:
                self.bonus, self.strict = bonus, strict

            def score(self, task, response):
                found = task.answer in (response if self.strict else response.lower())
                return Score(reward=1.0 + self.bonus if found else 0.0, correct=found)


        def contains_gold(task, completion):
            return 1.0 if task.answer in completion else 0.0


        def quarter(task, completion):
            return 0.25


        def never(task, completion):
            return 0.0


        def three_args(task, completion, extra):
            return 0.0


        class Picky:
            name = "picky"

            def __init__(self, bonus: float = 1.0) -> None:
                if bonus <= 0:
                    raise ValueError("bonus must be positive")

            def score(self, task, response):
                return Score(reward=0.0, correct=False)


        class NoScore:
            name = "no_score"

            def grade(self, task, response):
                return 0.0
    ''',
    "data.py": """
        from treadle.core.types import Message, Task


        def load_tasks(cfg):
            return [
                Task(f"user/{i}", (Message("user", f"What is {i} + 1?"),), str(i + 1), cfg.domain)
                for i in range(10)
            ]


        def not_tasks(cfg):
            return [{"question": "1 + 1", "answer": "2"}]
    """,
    "engine.py": '''
        from contracts.fakes import FakeEngine
        from transformers import AutoTokenizer


        class Engine(FakeEngine):
            """The fake engine, built as a plug-in is: Engine(spec)."""

            def __init__(self, spec):
                super().__init__(AutoTokenizer.from_pretrained(spec.model_dir))


        class NoSpec(Engine):
            def __init__(self):  # not Engine(spec)
                pass


        class Failing(Engine):
            def __init__(self, spec):
                raise RuntimeError("no accelerator here")


        class Half:
            policy_version = 0

            def __init__(self, spec):
                pass

            def generate(self, prompts, params):
                return []
    ''',
    "broken.py": """
        raise RuntimeError("boom at import")
    """,
}


def write_package(root: Path) -> Path:
    """Write :data:`FILES` as the package ``userplug`` under ``root``; forget any copy of it
    imported from another folder."""
    folder = root / PACKAGE
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in FILES.items():
        (folder / name).write_text(textwrap.dedent(text).lstrip())
    forget()
    return folder


def forget() -> None:
    """Drop the package's modules from ``sys.modules`` (each test writes its own copy)."""
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]
