"""Run a producer daemon as a child process: for the demo, tests and benchmarks.

``ProducerProcess`` starts ``python -m stoker.cli.main produce ...``, waits until
the daemon logs the endpoint it serves (so ``tcp://127.0.0.1:*`` works and the
real port is known), and stops it with SIGTERM, escalating to SIGKILL, always
within a bounded time. Its log goes to a file, never a pipe that could fill.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

from .procfs import stat_fields

_SERVING_RE = re.compile(r"serving .* on (\S+): ")
_STOPPED_RE = re.compile(r"stopped: (\d+) batches, (\d+) images sent, (\d+) records skipped")


class ProducerStartError(RuntimeError):
    """The daemon exited or did not report its endpoint in time; the message holds its log tail."""


class ProducerProcess:
    """A producer daemon subprocess. Use as a context manager; ``stop()`` is idempotent."""

    def __init__(self, lmdb_path: str | os.PathLike, bind: str = "tcp://127.0.0.1:*",
                 extra_args: Sequence[str] = (), start_timeout: float = 60.0,
                 log_path: str | os.PathLike | None = None, command_prefix: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, tie_to_parent: bool = True) -> None:
        """``command_prefix`` runs the daemon through another command, e.g. ``ip netns exec NS``;
        ``env`` replaces its environment (default: this process's); ``tie_to_parent``: the daemon stops when
        this process is gone (``--parent-pid``; needs the same PID namespace: turn it off for a prefix that
        runs the daemon elsewhere, such as ssh)."""
        # --parent-pid: if this process is killed outright (no stop()), the daemon and its workers still go.
        tie = ["--parent-pid", str(os.getpid())] if tie_to_parent else []
        self.args = [*command_prefix, sys.executable, "-m", "stoker.cli.main", "produce", "--lmdb", str(lmdb_path),
                     "--bind", bind, *tie, *extra_args]
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="stoker-producer-", suffix=".log")[1])
        self._log = open(self.log_path, "wb")  # truncate: an old "serving" line must not be mistaken for ours
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=dict(env) if env is not None else None)
        self.endpoint = self._wait_for_endpoint(start_timeout)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_for_endpoint(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _SERVING_RE.search(self.log_text())
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise ProducerStartError(f"producer {' '.join(self.args)} did not start (exit {self.proc.returncode}):\n"
                                 + self.log_text()[-3000:])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def child_pids(self) -> list[int]:
        """PIDs whose parent is the daemon (its workers), read from /proc."""
        children = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = stat_fields(int(entry.name))
                except OSError:
                    continue
                if int(fields[1]) == self.proc.pid:
                    children.append(int(entry.name))
        return children

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM, wait up to ``timeout``, then SIGKILL. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL without any chance to clean up, as a crash would."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def counters(self) -> tuple[int, int, int] | None:
        """``(batches, images, skipped)`` from the daemon's final log line, once it has stopped."""
        match = _STOPPED_RE.search(self.log_text())
        return tuple(int(g) for g in match.groups()) if match else None  # type: ignore[return-value]

    def __enter__(self) -> "ProducerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
