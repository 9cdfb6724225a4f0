"""The status file: the daemon's channel for programs, both ends (``StatusFile`` writes, ``DaemonStatus`` reads).

The file (``stoker produce --status-file PATH``, ``ProducerConfig.status_file``) is the daemon's
channel for programs; the log's wording is for people and may change. The daemon truncates the
file when it starts, then appends one JSON object per line, each line a single ``write()``
(flushed, never interleaved), so a reader that keeps only complete lines never sees a torn one:

    {"event": "serving", "pid": 4242, "endpoint": "tcp://127.0.0.1:40123",
     "producer_id": "host:40123#0/2~a1b2c3", "mode": "plain", "epochs": null, "shard": "0/2",
     "records": 512, "seed": 7, "workers": 2, "metrics_port": null}
    {"event": "stopped", "pid": 4242, "batches": 120, "images": 960, "skipped": 0, "restarts": 0}

``serving`` comes once, when the socket is bound and the workers are started (the moment the log
says "serving"): ``endpoint`` is the bound address (the real port for ``tcp://HOST:*``), ``mode``
is ``plain``, ``exact`` or ``pool`` (``--shard auto``), ``epochs`` null when endless,
``metrics_port`` the Prometheus port or null. ``stopped`` comes once, last, when ``run()`` ends for
any reason (the figures of the log's "stopped:" line: batches and images the workers made to send,
records skipped, workers restarted; exact mode's trainers that said ``goodbyes`` and ``trainers_lost`` without one;
``error`` when workers died in a way restarting cannot heal, see producer/supervision/). A
daemon killed outright writes no ``stopped``; one that fails before serving writes nothing. Readers
ignore fields and events they do not know.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Optional


class StatusFile:
    """The daemon's end of its JSON-lines channel for programs (format: this module's docstring;
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
