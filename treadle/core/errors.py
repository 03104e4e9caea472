"""The one error type for bad user input.

The CLI turns a :class:`UserError` into a single line on stderr and exit code 2 with no
traceback; everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: the message names the input and the fix."""


def one_line(text: str) -> str:
    """``text`` with its line breaks written ``\\n`` and ``\\r``: a message meant as one line
    (a refusal, a path said to copy) stays one, whatever name it quotes."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


class StaleWeightsError(RuntimeError):
    """An engine serves weights other than the trainer's current ones (a weight sync was skipped
    or failed): training on its completions would silently mix policies."""
