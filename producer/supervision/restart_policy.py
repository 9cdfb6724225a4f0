"""When a dead worker is restarted, which record it is made to skip, and when the producer gives up instead.

A worker dies of what Python cannot catch: a signal (SIGBUS from a file cut short under its mmap, SIGSEGV in a
decoder, the OOM killer) or an error before it serves anything (a dataset it cannot open). Restarted at once and
for ever, such a worker dies again on the same record, twice a second, and the trainer only sees nothing arrive
(issue 39). So each death is judged by what the worker was doing (``worker_progress.WorkerProgress``):

- a death *on a record* counts against that record; the ``DEATHS_TO_SKIP``-th death on one record marks it
  skipped: every worker then skips it without reading (counted as skipped, in exact mode reported to the
  trainer like any bad record), and the run goes on;
- a death *before the worker was ready* (loading the pipeline, opening the dataset) ``STARTUP_DEATHS`` times in a
  row is fatal: the producer stops with the cause, as nothing would ever come of restarting it;
- a worker that dies again without having made a record since its last start is restarted after a growing delay
  (``RESTART_DELAYS_S``, bounded); ``FRUITLESS_DEATHS`` such deaths in a row are fatal, as are more than
  ``MAX_SKIPPED_RECORDS`` records skipped this way (the data is damaged beyond skipping records).

Logic only: no processes, the clock is passed in, so it is tested on its own.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Optional

DEATHS_TO_SKIP = 2  # one death on a record may be bad luck (an OOM kill); a second on the same one is the record
STARTUP_DEATHS = 3
FRUITLESS_DEATHS = 8
MAX_SKIPPED_RECORDS = 64
RESTART_DELAYS_S = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)  # by deaths in a row without a record made; the last repeats


@dataclass(frozen=True)
class Death:
    """What a worker was doing when it died (read from ``WorkerProgress`` once it is gone)."""

    worker: int
    exitcode: Optional[int]
    ready: bool  # it had loaded its pipeline and opened its dataset
    record: Optional[tuple[int, int]]  # (epoch, index) it was making, None between records
    made: int  # records it made (or skipped) since it started
    error: str = ""  # the error it reported before dying, if any

    def cause(self) -> str:
        """``killed by SIGBUS``, ``exit code 1: DatasetError: ...``: what people read."""
        code = self.exitcode
        if code is not None and code < 0:
            try:
                said = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                said = f"killed by signal {-code}"
        else:
            said = f"exit code {code}"
        return f"{said}: {self.error}" if self.error else said


@dataclass(frozen=True)
class Decision:
    """What to do about one death: restart after ``delay_s``, with ``skip`` marked skipped first (None: nothing
    new to skip), or stop the producer (``fatal``: why, for the log, the status file and the exit)."""

    delay_s: float = 0.0
    skip: Optional[int] = None
    fatal: Optional[str] = None
    message: str = ""  # the log line saying what happened and what is done about it


@dataclass
class RestartPolicy:
    """See the module doc. ``on_death`` for each dead worker, in the order they are found."""

    deaths_to_skip: int = DEATHS_TO_SKIP
    startup_deaths: int = STARTUP_DEATHS
    fruitless_deaths: int = FRUITLESS_DEATHS
    max_skipped: int = MAX_SKIPPED_RECORDS
    delays_s: tuple[float, ...] = RESTART_DELAYS_S
    skipped: set[int] = field(default_factory=set)  # records every worker skips
    restarts: int = 0
    _on_record: dict[int, int] = field(default_factory=dict)  # record index -> deaths on it
    _in_a_row: dict[int, int] = field(default_factory=dict)  # worker -> deaths without a record made
    _at_start: dict[int, int] = field(default_factory=dict)  # worker -> deaths before ready, in a row

    def on_death(self, death: Death) -> Decision:
        """The decision for ``death``; the policy remembers it (deaths in a row, deaths per record)."""
        w = death.worker
        self._in_a_row[w] = 1 if death.made else self._in_a_row.get(w, 0) + 1
        self._at_start[w] = 0 if death.ready else self._at_start.get(w, 0) + 1
        said = f"worker {w} died ({death.cause()})"
        if self._at_start[w] >= self.startup_deaths:
            return Decision(fatal=f"{said} before it was ready, {self._at_start[w]} times in a row: restarting it "
                                  "cannot help; fix the cause and start the producer again")
        skip, what = None, ""
        if death.record is not None:
            epoch, index = death.record
            deaths = self._on_record[index] = self._on_record.get(index, 0) + 1
            what = f" making record {index:08d} (epoch {epoch})"
            if deaths >= self.deaths_to_skip and index not in self.skipped:
                if len(self.skipped) >= self.max_skipped:
                    return Decision(fatal=f"{said}{what}, and {len(self.skipped)} records already killed workers: "
                                          "the dataset is damaged beyond skipping records; copy it again or rebuild it")
                skip = index
                self.skipped.add(index)
                self._in_a_row[w] = 0  # the record is out of the way: the next start is not fruitless
        if self._in_a_row[w] >= self.fruitless_deaths:
            return Decision(fatal=f"{said}{what}, {self._in_a_row[w]} times in a row without making a record: "
                                  "restarting it cannot help; fix the cause and start the producer again")
        delay = self.delays_s[min(max(self._in_a_row[w] - 1, 0), len(self.delays_s) - 1)]
        self.restarts += 1
        if skip is not None:
            message = (f"{said}{what}, the {_nth(self._on_record[skip])} death on it: every worker skips that record "
                       "from now on (counted as skipped); restarting the worker")
        else:
            message = f"{said}{what}; restarting it" + (f" in {delay:g} s" if delay else "")
        return Decision(delay_s=delay, skip=skip, message=message)


def _nth(n: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")
