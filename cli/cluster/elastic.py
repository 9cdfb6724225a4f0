"""``stoker cluster --add-host-at/--remove-host-at``: an elastic pool on simulated hosts, and what it did.

- ``PoolNames`` makes the pool a *name*, as a Kubernetes headless Service does: ``stoker-producers``
  resolves, inside each trainer's namespace, to the data hosts in the pool now. ``ip netns exec``
  bind-mounts ``/etc/netns/NS/hosts`` over ``/etc/hosts`` (and ``host.conf``, with ``multi on`` so a
  name may have several addresses); the file is rewritten in place (same inode), so a running trainer's
  next lookup sees the change. The folder is removed on close.
- ``ConsumedWatcher`` reads the trainers' ``--log-consumed`` files as they grow: images/s over each
  interval, and at the end each epoch's coverage (distinct records seen / records) and records seen twice,
  in summary: one line for the epochs every record of which came exactly once, one line each for the others.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter, defaultdict
from pathlib import Path
from typing import Sequence

POOL_NAME = "stoker-producers"
NETNS_ETC = Path("/etc/netns")


class PoolNames:
    """``POOL_NAME`` -> the given addresses, in each of ``namespaces`` (see the module doc)."""

    def __init__(self, namespaces: Sequence[str]) -> None:
        self.folders = [NETNS_ETC / ns for ns in namespaces]
        for folder in self.folders:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "host.conf").write_text("multi on\n")
            (folder / "hosts").write_text("127.0.0.1 localhost\n")

    def set(self, addresses: Sequence[str]) -> None:
        text = "127.0.0.1 localhost\n" + "".join(f"{a} {POOL_NAME}\n" for a in addresses)
        for folder in self.folders:
            with open(folder / "hosts", "r+") as f:  # in place: the bind mount follows the inode
                f.write(text)  # over the old text, then cut: a reader never sees an empty file
                f.truncate()

    def close(self) -> None:
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)


class ConsumedWatcher:
    """Rows the trainers' steps consumed, read from their JSON-lines logs as they grow."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = list(paths)
        self._offsets = [0] * len(self.paths)
        self.rows = 0
        self.seen: dict[int, Counter] = defaultdict(Counter)

    def poll(self) -> int:
        """Read what was appended since; the rows (images) it held."""
        new = 0
        for k, path in enumerate(self.paths):
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self._offsets[k])
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
            self._offsets[k] += end
            for line in data[:end].splitlines():
                try:
                    step = json.loads(line)
                except ValueError:
                    continue
                for e, i in zip(step.get("epoch", []), step.get("index", [])):
                    self.seen[int(e)][int(i)] += 1
                    new += 1
        self.rows += new
        return new

    def print_coverage(self, records: int) -> None:
        """Read what the trainers logged last, then print ``coverage`` under its heading (the end of a run)."""
        self.poll()
        print("coverage (records the steps consumed, all trainers):", flush=True)
        for line in self.coverage(records):
            print(f"  {line}", flush=True)

    def coverage(self, records: int) -> list[str]:
        """Each epoch's coverage, summarised: one line for the epochs whose ``records`` all came exactly once
        ("epochs 0-56, 58 (58 epochs): ..."), then one per other epoch (cut short, or with records seen more than
        once): distinct records seen, and how many came more than once."""
        exact: list[int] = []
        lines: list[str] = []
        for epoch in sorted(self.seen):
            counts = self.seen[epoch]
            twice = sum(1 for n in counts.values() if n > 1)
            if len(counts) == records and not twice:
                exact.append(epoch)
                continue
            lines.append(f"epoch {epoch}: {len(counts)}/{records} records ({100 * len(counts) / records:.1f}%), "
                         f"{twice} seen more than once")
        if len(exact) == 1:
            lines.insert(0, f"epoch {exact[0]}: {records}/{records} records (100.0%), none seen more than once")
        elif exact:
            lines.insert(0, f"epochs {epoch_ranges(exact)} ({len(exact)} epochs): {records}/{records} records each "
                            "(100.0%), none seen more than once")
        return lines or ["no records consumed"]


def epoch_ranges(epochs: Sequence[int]) -> str:
    """Sorted epoch numbers as ranges: ``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    runs: list[list[int]] = []
    for epoch in epochs:
        if runs and epoch == runs[-1][1] + 1:
            runs[-1][1] = epoch
        else:
            runs.append([epoch, epoch])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
