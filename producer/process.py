"""Run a producer daemon as a child process: for the demo, tests and benchmarks.

``ProducerProcess`` starts ``python -m stoker.cli.main produce ... --status-file PATH``
(PATH in a temporary folder of its own, removed once both have the file open, so even a
launcher killed outright leaves nothing) and waits until the daemon's status file says it
is serving, with the endpoint it bound (so ``tcp://127.0.0.1:*`` works and the real port
is known) and its producer id; at the stop it reads the daemon's summary from the same
file. The status file is the daemon's channel for programs (its format and both ends:
``stoker.producer.serve.status_file``; here ``DaemonStatus`` reads it); the log is for people,
and nothing here reads its wording. The daemon is stopped with SIGTERM, escalating to SIGKILL,
always within a bounded time. Its log goes to a file, never a pipe that could fill. Its command
line comes from ``produce_command.py``; ``throttle.Throttle`` makes one a straggler.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

from stoker.producer.measure.procfs import stat_fields
from stoker.producer.produce_command import produce_command, produce_flags
from stoker.producer.serve.status_file import DaemonStatus


class ProducerStartError(RuntimeError):
    """The daemon exited or did not report its endpoint in time; the message holds its log tail."""


class ProducerProcess:
    """A producer daemon subprocess. Use as a context manager; ``stop()`` is idempotent."""

    def __init__(self, lmdb_path: str | os.PathLike, bind: str = "tcp://127.0.0.1:*",
                 extra_args: Sequence[str] = (), start_timeout: float = 60.0,
                 log_path: str | os.PathLike | None = None, command_prefix: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, tie_to_parent: bool = True) -> None:
        """``command_prefix`` runs the daemon through another command on this host's file system, e.g. ``ip netns
        exec NS`` (the daemon writes its status file into a folder made here); ``env`` replaces its environment
        (default: this process's); ``tie_to_parent``: the daemon stops when this process is gone (``--parent-pid``;
        needs the same PID namespace)."""
        status_dir = tempfile.mkdtemp(prefix="stoker-producer-status-")
        # Removed once the daemon and we have the file open (see _wait_for_serving), or by stop()/kill(), or when
        # this object is collected or the interpreter exits, whichever is first.
        self._remove_status_dir = weakref.finalize(self, shutil.rmtree, status_dir, True)
        self.status = DaemonStatus(Path(status_dir) / "status.jsonl")
        # --parent-pid: if this process is killed outright (no stop()), the daemon and its workers still go.
        # --status-file last: the launcher's own channel, whatever extra_args say.
        self.args = [*command_prefix, *produce_command(lmdb_path, bind, [
            *produce_flags(parent_pid=os.getpid() if tie_to_parent else None), *extra_args,
            *produce_flags(status_file=self.status.path)])]
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="stoker-producer-", suffix=".log")[1])
        self._log = open(self.log_path, "wb")  # truncate: people read it; the status file is what we read
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=dict(env) if env is not None else None)
        #: ``time.monotonic()`` when ``stop()`` was first asked of it while it ran (None: not yet, or it exited)
        self.stopped_at: float | None = None
        #: the daemon's "serving" status line: endpoint, producer_id, pid, mode, shard, ... (see serve/status_file.py)
        self.serving = self._wait_for_serving(start_timeout)
        self.started_at = time.monotonic()  # when it was serving
        #: the address it bound: the real port where ``bind`` asked for ``*``
        self.endpoint: str = self.serving["endpoint"]
        #: the id in its batch headers (``--id``, or the daemon's unique default)
        self.producer_id: str = self.serving.get("producer_id", "")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_for_serving(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exited = self.proc.poll() is not None
            serving = self.status.event("serving")  # after poll(): a line written just before an exit counts
            if serving is not None and "endpoint" in serving:
                # Both ends hold the file open: unlinked now, nothing is left behind even if we are SIGKILLed.
                self._remove_status_dir()
                return serving
            if exited:
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
        self._exited()
        return self.proc.returncode

    def _exited(self) -> None:
        """Once the daemon is gone: keep what its status file says, remove the folder, close the log."""
        self.status.poll()
        self.status.close()
        self._remove_status_dir()
        self._log.close()

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
            self._exited()

    def counters(self) -> tuple[int, int, int] | None:
        """``(batches, images, skipped)`` from the daemon's "stopped" status line, once it has stopped (None: not
        yet, or it was killed before it could write one)."""
        stopped = self.status.event("stopped")
        if stopped is None:
            return None
        return int(stopped["batches"]), int(stopped["images"]), int(stopped["skipped"])

    def __enter__(self) -> "ProducerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
