"""The console the commands print to: the terminal's width, or a wide one in a log."""

from __future__ import annotations

import os
import sys

from rich.console import Console

LOG_WIDTH = 160  # a pipe or a file has no width: tables this wide stay whole in a log


def make_console() -> Console:
    """A console sized by the terminal (or COLUMNS); LOG_WIDTH when stdout is not one."""
    if sys.stdout.isatty() or "COLUMNS" in os.environ:
        return Console()
    return Console(width=LOG_WIDTH)
