"""The ``treadle`` console script: :func:`treadle.cli.main` behind a guard for a Ctrl-C that
comes while the CLI's own modules import (argparse, logging, the commands' parsers: tens of
milliseconds), which would otherwise end in a traceback. Imports nothing itself."""

import sys


def main() -> int:
    """Import the CLI and run it; 130 with one line on stderr if Ctrl-C comes first."""
    try:
        from treadle.cli import main as cli_main
    except KeyboardInterrupt:
        try:
            sys.stderr.write("treadle: interrupted while starting; nothing was written\n")
            sys.stderr.flush()
        except (AttributeError, OSError):  # stderr closed or gone: the status says it
            pass
        return 130
    return cli_main()
