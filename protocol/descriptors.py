"""The limit on open files, raised for processes that hold many sockets: a trainer connected to a thousand
producers, a fleet process serving a thousand endpoints. Both sides call it, so it sits in the bottom layer."""

from __future__ import annotations

import errno
import resource


def raise_open_files_limit(needed: int, who: str, instead: str) -> None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit when it is below ``needed`` (left alone when it is not);
    OSError (EMFILE) when the hard limit is below ``needed`` too, the limit unchanged, saying ``who`` needs how many
    files, how to raise the limit (``ulimit -n``, ``LimitNOFILE=``) and what to do ``instead``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise OSError(errno.EMFILE, f"{who} need about {needed} open files but this process may open at most {hard}: "
                      f"raise the limit (ulimit -n {needed}, or LimitNOFILE= in a systemd unit) or {instead}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
