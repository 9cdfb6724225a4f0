"""The local producer as a running child: started niced and pinned, watched, stopped within a bounded time.

``LocalProducerProcess`` runs ``python -c LAUNCH NICE CPUS python -m stoker.cli.main produce ...``: the launcher
lowers its priority and pins it, then ``exec``s the producer, whose workers inherit both (no ``preexec_fn``,
unsafe in a threaded trainer; no ``nice``/``taskset`` binaries needed). It binds ``ipc://TMP/stoker-local-PID.sock``
in a folder of its own; it is tied to this process (``--parent-pid``: a trainer killed outright leaves no
producer behind) and runs in its own session (Ctrl-C at the trainer's terminal reaches the trainer, whose
``close()`` stops it). Its log goes to a file in that folder, never a pipe that could fill.

A watcher thread waits on it: an exit nobody asked for is a death, logged with the log's tail and counted
(``deaths``); the input goes on with the remote producers. ``stop()`` (the facade's ``close()``; otherwise when
this object is collected or the interpreter exits) sends SIGTERM, waits ``stop_timeout``, then SIGKILLs its
process group (the producer and its workers).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from secrets import token_hex
from typing import IO, Optional

from stoker.consumer.placement.local_producer import LOCAL_PREFIX, LocalProducer

log = logging.getLogger("stoker.consumer")

#: a Unix socket path longer than this does not fit ``sockaddr_un`` (108 bytes with its NUL, on Linux)
MAX_SOCKET_PATH = 107
#: the log's tail quoted when the producer fails to start or dies
LOG_TAIL_BYTES = 3000
#: seconds between looks at a starting producer (its socket file, its exit)
START_POLL_S = 0.05
#: what the launcher does before it becomes the producer: nice, pin (an empty CPU list: the affinity as it is), exec
LAUNCH = ("import os, sys\n"
          "os.nice(int(sys.argv[1]))\n"
          "if sys.argv[2]:\n"
          "    os.sched_setaffinity(0, [int(c) for c in sys.argv[2].split(',')])\n"
          "os.execv(sys.executable, [sys.executable, *sys.argv[3:]])\n")


class LocalProducerError(RuntimeError):
    """The local producer did not start: it exited, or bound nothing within ``start_timeout``; with its log's tail."""


class _Watch:
    """What the watcher thread shares with its owner (not the owner itself, which stays collectable)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stopping = False  # set before we stop it: that exit is no death
        self.deaths = 0


class LocalProducerProcess:
    """A running local producer (``LocalProducer.start()``): ``address``, ``producer_id``, ``pid``, ``deaths``,
    ``running``; ``stop()`` is idempotent and bounded (``stop_timeout`` + 5 s at most)."""

    def __init__(self, spec: LocalProducer) -> None:
        self.spec = spec
        self.folder = Path(tempfile.mkdtemp(prefix="stoker-local-"))
        socket_path = self.folder / f"stoker-local-{os.getpid()}.sock"
        if len(str(socket_path)) > MAX_SOCKET_PATH:
            shutil.rmtree(self.folder, True)
            raise LocalProducerError(f"the socket path {socket_path} is longer than a Unix socket takes "
                                     f"({MAX_SOCKET_PATH} bytes): set TMPDIR to a shorter folder")
        #: the address the input reads it at
        self.address = f"ipc://{socket_path}"
        #: the id in its batch headers: ``local-HOST-PID-XXXX``
        self.producer_id = local_producer_id()
        self.log_path = self.folder / "producer.log"
        self._log: IO[bytes] = open(self.log_path, "wb")
        self.command = spec.command(self.address, self.producer_id, os.getpid())
        cpus = ",".join(str(c) for c in spec.cpus) if spec.cpus is not None else ""
        self._proc = subprocess.Popen([sys.executable, "-c", LAUNCH, str(spec.nice), cpus, *self.command[1:]],
                                      stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        self._watch = _Watch()
        self._watcher = threading.Thread(target=_watch_exit, name="stoker-local-producer", daemon=True,
                                         args=(self._proc, self._watch, self.producer_id, self.log_path))
        # Stopped by stop(), or when this object is collected (a facade's constructor that failed after it
        # started), or at the interpreter's exit; the function holds no reference to self.
        self._stop = weakref.finalize(self, _stop_child, self._proc, self._watch, self._watcher, self._log,
                                      self.folder, spec.stop_timeout)
        self._wait_until_bound(socket_path, spec.start_timeout)
        self._watcher.start()  # from now on an exit is a death (before, a failed start: raised, not counted)
        log.info("local producer %s serving on %s (%d workers, nice +%d, cpus %s)", self.producer_id, self.address,
                 spec.workers, spec.nice, cpus or "any")

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc.poll() is None

    @property
    def deaths(self) -> int:
        """Exits nobody asked for (0 or 1: a dead local producer is not restarted; the remote ones go on)."""
        with self._watch.lock:
            return self._watch.deaths

    def wait_exit(self, timeout: Optional[float] = None) -> Optional[int]:
        """Wait until it exits and the watcher has judged the exit (a death is counted by then), up to ``timeout``
        seconds; its exit code, or None if it still runs."""
        if self._watcher.ident is not None:
            self._watcher.join(timeout)
        return self._proc.returncode

    def stop(self) -> Optional[int]:
        """SIGTERM, wait up to ``stop_timeout``, then SIGKILL (its group) and 5 s more; its folder removed. Never
        raises. Returns the exit code (None: it outlived even that, logged)."""
        self._stop()
        return self._proc.returncode

    def _wait_until_bound(self, socket_path: Path, timeout: float) -> None:
        """Until its socket exists (it binds after opening the dataset, so a bad location fails here, named)."""
        deadline = time.monotonic() + timeout
        while not socket_path.exists():
            if self._proc.poll() is not None or time.monotonic() >= deadline:
                code, tail = self._proc.poll(), _log_tail(self.log_path)
                self.stop()
                why = f"exited {code}" if code is not None else f"bound nothing within {timeout:g} s"
                raise LocalProducerError(f"the local producer {' '.join(self.command)} {why}; its log ends:\n{tail}")
            time.sleep(START_POLL_S)


def local_producer_id() -> str:
    """``local-HOST-PID-XXXX``: local, on which trainer host, for which trainer process, which start."""
    host = "".join(c for c in socket.gethostname() if c.isalnum() or c in ".-_")[:64] or "host"
    return f"{LOCAL_PREFIX}{host}-{os.getpid()}-{token_hex(2)}"


def _watch_exit(proc: subprocess.Popen, watch: _Watch, producer_id: str, log_path: Path) -> None:
    """The watcher thread: wait for the producer's exit; one nobody asked for is a death, logged and counted."""
    code = proc.wait()
    with watch.lock:
        if watch.stopping:
            return
        if code == 0:  # a finite run (--epochs N) that served its epochs: done, not dead
            log.info("local producer %s finished (exit 0)", producer_id)
            return
        watch.deaths += 1
    log.warning("local producer %s died (exit %s); training goes on with the remote producers. Its log "
                "ends:\n%s", producer_id, code, _log_tail(log_path))


def _stop_child(proc: subprocess.Popen, watch: _Watch, watcher: threading.Thread, log_file: IO[bytes],
                folder: Path, timeout: float) -> None:
    with watch.lock:
        watch.stopping = proc.poll() is None or watch.stopping  # a death already counted stays counted
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            # Its whole group (it leads its own session): workers too. Not reaped yet, so the id is still its own.
            # Both may race its exit (the group gone, or a child that outlives the kill in D state): stop() and the
            # finalizer never raise, a producer left over is said.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # the whole group exited between the wait and the kill
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                log.warning("local producer pid %d did not exit 5 s after SIGKILL; left to the system", proc.pid)
    if watcher.ident is not None:  # started: the producer had bound
        watcher.join(5)
    log_file.close()
    shutil.rmtree(folder, True)


def _log_tail(path: Path) -> str:
    """The last ``LOG_TAIL_BYTES`` of the log, read from there (the log may be long)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - LOG_TAIL_BYTES))
            return f.read(LOG_TAIL_BYTES).decode(errors="replace")
    except OSError as exc:
        return f"(its log {path} could not be read: {exc.strerror})"
