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
import threading
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

from stoker.producer.measure.procfs import stat_fields

_SERVING_RE = re.compile(r"serving .* on (\S+): .*\n")  # a whole line: the id comes at its end
_ID_RE = re.compile(r"serving .* producer_id=([^\s\"]+)")
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
        #: ``time.monotonic()`` when ``stop()`` was first asked of it while it ran (None: not yet, or it exited)
        self.stopped_at: float | None = None
        self.endpoint = self._wait_for_endpoint(start_timeout)
        self.started_at = time.monotonic()  # when it was serving
        match = _ID_RE.search(self.log_text())
        #: the id in its batch headers (``--id``, or the daemon's unique default), from its "serving" log line
        self.producer_id = match.group(1) if match else ""

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
            if self.stopped_at is None:
                self.stopped_at = time.monotonic()
            self.resume()  # a paused daemon would not see SIGTERM until the SIGKILL
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode

    def pause(self) -> None:
        """SIGSTOP the daemon and its workers, as a paused VM or a host in a swap storm: its connections stay up
        (its kernel still answers), it sends nothing. ``resume()`` continues it; ``stop()`` resumes it first."""
        self._signal_tree(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_tree(signal.SIGCONT)

    def _signal_tree(self, sig: int) -> None:
        if self.proc.poll() is not None:
            return
        for pid in [self.proc.pid, *self.child_pids()]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL without any chance to clean up, as a crash would."""
        if self.proc.poll() is None:
            self.stopped_at = self.stopped_at or time.monotonic()
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


class Throttle:
    """Runs a producer at about ``1/slowdown`` of its speed, paused and resumed in turn (a straggler: a host short of
    CPU, a slow disk), while the ``with`` block lasts; resumed at the end."""

    def __init__(self, producer: ProducerProcess, slowdown: float = 4.0, period_s: float = 0.2) -> None:
        self.producer, self.run_s = producer, period_s / slowdown
        self.stop_s = period_s - self.run_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._done.is_set():
            self.producer.pause()
            self._done.wait(self.stop_s)
            self.producer.resume()
            self._done.wait(self.run_s)

    def __enter__(self) -> "Throttle":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5)
        self.producer.resume()
