"""Run a producer daemon as a child process: for the demo, tests and benchmarks.

``ProducerProcess`` starts ``python -m stoker.cli.main produce ... --status-file PATH``
(PATH in a temporary folder of its own, removed once both have the file open, so even a
launcher killed outright leaves nothing) and waits until the daemon's status file says it
is serving, with the endpoint it bound (so ``tcp://127.0.0.1:*`` works and the real port
is known) and its producer id; at the stop it reads the daemon's summary from the same
file. The status file is the daemon's channel for programs (its format:
``stoker.producer.serve.daemon``'s docstring; both ends are here: ``StatusFile`` writes,
``DaemonStatus`` reads); the log is for people, and nothing here reads its wording. The daemon is stopped with SIGTERM, escalating to SIGKILL, always
within a bounded time. Its log goes to a file, never a pipe that could fill.

``produce_flags`` and ``produce_command`` build ``stoker produce`` command lines from
typed arguments: the one place that spells its flags for launchers (``stoker cluster``
and the demo use them too; ``stoker.cli.command_lines`` adds ``stoker train``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, BinaryIO, Mapping, Optional, Sequence

from stoker.producer.measure.procfs import stat_fields


def produce_flags(*, workers: Optional[int] = None, batch_size: Optional[int] = None,
                  image_size: Optional[int] = None, mode: Optional[str] = None, shard: Optional[str] = None,
                  seed: Optional[int] = None, producer_id: Optional[str] = None, epochs: Optional[int] = None,
                  min_trainers: Optional[int] = None, repeat_batches: Optional[int] = None,
                  parent_pid: Optional[int] = None, status_file: Optional[str | os.PathLike] = None,
                  exact: bool = False, trainer_timeout: Optional[float] = None) -> list[str]:
    """``stoker produce`` flags for the given settings, in this order; ``None`` leaves a flag out (its default)."""
    values: list[tuple[str, object]] = [
        ("--workers", workers), ("--batch-size", batch_size), ("--mode", mode), ("--image-size", image_size),
        ("--shard", shard), ("--seed", seed), ("--id", producer_id), ("--epochs", epochs),
        ("--min-trainers", min_trainers), ("--repeat-batches", repeat_batches), ("--parent-pid", parent_pid),
        ("--status-file", status_file), ("--trainer-timeout", trainer_timeout),
    ]
    flags = [text for flag, value in values if value is not None for text in (flag, str(value))]
    return flags + (["--exact"] if exact else [])


def produce_command(lmdb_path: str | os.PathLike, bind: str, flags: Sequence[str] = ()) -> list[str]:
    """The argv of ``stoker produce --lmdb LMDB_PATH --bind BIND FLAGS...`` run by this Python interpreter."""
    return [sys.executable, "-m", "stoker.cli.main", "produce", "--lmdb", str(lmdb_path), "--bind", bind, *flags]


class StatusFile:
    """The daemon's end of its JSON-lines channel for programs (format: ``stoker.producer.serve.daemon``'s docstring;
    ``DaemonStatus`` is the reading end); no-op without a path.

    Opened (truncated) at once, so a path that cannot be written fails before anything starts. Each line is
    one ``os.write`` on an ``O_APPEND`` descriptor: no buffer to flush, no torn or interleaved lines.
    """

    def __init__(self, path: Optional[str]) -> None:
        self._fd: Optional[int] = None
        if path is not None:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise ValueError(f"cannot write the status file {path}: {exc.strerror}") from None

    def write(self, event: str, **fields: object) -> None:
        if self._fd is not None:
            line = json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n"
            os.write(self._fd, line.encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class DaemonStatus:
    """The events a daemon wrote to its status file, read as the file grows (complete lines only).

    The file stays open from the first read on, so it may be unlinked then; ``close()`` ends the reading.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []
        self._file: Optional[BinaryIO] = None
        self._closed = False
        self._partial = b""

    def poll(self) -> None:
        """Read what was appended since; a file not yet made by the daemon, or a closed reader, adds nothing."""
        if self._closed:
            return
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # the daemon makes it (O_CREAT|O_TRUNC at once): never stale
            except FileNotFoundError:
                return
        data = self._partial + self._file.read()
        end = data.rfind(b"\n") + 1  # a line is one write, but a read can still catch a write in progress
        self._partial = data[end:]
        for line in data[:end].splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                self.events.append(event)

    def close(self) -> None:
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None

    def event(self, name: str) -> Optional[dict[str, Any]]:
        """The first event called ``name`` ("serving", "stopped") read so far, after reading what is new."""
        self.poll()
        return next((e for e in self.events if e.get("event") == name), None)


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
        #: the daemon's "serving" status line: endpoint, producer_id, pid, mode, shard, ... (see the daemon's docs)
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
