"""The one error type for bad user input.

The CLI turns a :class:`UserError` into a single line on stderr and exit code 2 with no
traceback; everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: the message names the input and the fix."""
