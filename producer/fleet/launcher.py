"""``FleetProcesses``: a fleet of ``endpoints`` producer endpoints in ``processes`` child processes, for tests and
benchmarks (``ProducerProcess``'s counterpart for a fleet).

Each child is ``python -m stoker.producer.fleet`` serving a contiguous block of the fleet's shards, tied to this
process (``--parent-pid``); the launcher waits until every endpoint's "serving" line is in its process's status
file (the daemon's format, read with ``DaemonStatus``), so ``addresses`` are known and bound when it returns.
Stopped with SIGTERM, escalating to SIGKILL, within a bounded time; logs go to files, never to pipes that fill.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from stoker.producer.serve.status_file import DaemonStatus


class FleetStartError(RuntimeError):
    """A fleet process exited, or did not report every endpoint in time; the message holds its log's tail."""


class FleetProcesses:
    """``endpoints`` endpoints over ``processes`` processes, serving when constructed. Use as a context manager.

    ``addresses[i]``: endpoint ``i``'s ``tcp://`` address (it serves shard ``i/endpoints``); ``serving``: every
    endpoint's "serving" status line, in the same order; ``extra_args``: more flags of every process
    (``--records``, ``--batch-size``, ``--image-size``, ``--seed``).
    """

    def __init__(self, endpoints: int, processes: int = 2, extra_args: Sequence[str] = (),
                 start_timeout: float = 120.0) -> None:
        if not 1 <= processes <= endpoints:
            raise ValueError(f"need 1 <= processes <= endpoints, got {processes} processes for {endpoints} endpoints")
        self.folder = Path(tempfile.mkdtemp(prefix="stoker-fleet-"))
        self.procs: list[subprocess.Popen] = []
        self._statuses: list[DaemonStatus] = []
        self._logs: list[Any] = []
        base, extra = divmod(endpoints, processes)
        first = 0
        try:
            for p in range(processes):
                count = base + (p < extra)
                status = DaemonStatus(self.folder / f"fleet{p}.jsonl")
                log = open(self.folder / f"fleet{p}.log", "wb")
                self._statuses.append(status)
                self._logs.append(log)
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "stoker.producer.fleet", "--first", str(first), "--count", str(count),
                     "--of", str(endpoints), "--parent-pid", str(os.getpid()), *extra_args,
                     "--status-file", str(status.path)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
                first += count
            self.serving = self._wait_for_serving([base + (p < extra) for p in range(processes)], start_timeout)
        except BaseException:
            self.close()
            raise
        self.addresses: list[str] = [line["endpoint"] for line in self.serving]

    def _wait_for_serving(self, counts: list[int], timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            lines = []
            for p, (proc, status, count) in enumerate(zip(self.procs, self._statuses, counts)):
                exited = proc.poll() is not None
                status.poll()
                serving = [e for e in status.events if e.get("event") == "serving"]
                if len(serving) < count and (exited or time.monotonic() > deadline):
                    why = f"exited {proc.returncode}" if exited else f"reported {len(serving)} of {count} endpoints"
                    raise FleetStartError(f"fleet process {p} {why} within {timeout:.0f} s:\n"
                                          + self.log_text(p)[-3000:])
                lines.extend(serving)
            if len(lines) == sum(counts):
                return lines
            time.sleep(0.05)

    def log_text(self, process: int) -> str:
        return (self.folder / f"fleet{process}.log").read_text(errors="replace")

    def stopped(self) -> list[dict[str, Any]]:
        """Each process's "stopped" status line (after ``stop()``; empty for one killed before it wrote it)."""
        lines = []
        for status in self._statuses:
            status.poll()
            lines.extend(e for e in status.events if e.get("event") == "stopped")
        return lines

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every process, wait up to ``timeout``, then SIGKILL; idempotent."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for status in self._statuses:
            status.poll()
        for log in self._logs:
            log.close()

    def close(self) -> None:
        """Stop, then remove the folder of status files and logs."""
        self.stop()
        for status in self._statuses:
            status.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "FleetProcesses":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
