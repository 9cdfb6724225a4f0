"""What Linux's /proc says about a process: whether it still runs, its parent, its CPU time.

One parser for ``/proc/PID/stat`` (the command name in parentheses may hold spaces, so the
fields are read after the last ``)``). ``stat_fields`` and ``cpu_seconds`` raise OSError for a
process that is gone; ``running`` says False for one that is gone or a zombie (exited, not
yet reaped by its parent).
"""

from __future__ import annotations

import os
from pathlib import Path


def stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name: state first, then the parent's pid, ...
    OSError if the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        return stat_fields(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far; OSError if it is gone."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
