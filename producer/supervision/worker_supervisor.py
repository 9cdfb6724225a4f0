"""The daemon's workers kept running: started, and restarted when they die, as ``RestartPolicy`` decides.

The daemon calls ``check`` from its loop (twice a second). A dead worker is judged from its shared row
(``WorkerProgress``) and restarted at once or after its delay; a record the policy skips is put on the shared
skip list first, so no worker reads it again. ``WorkerCrashLoop`` when the policy gives up: the daemon stops,
and says why in its log, its status file and its exit status.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from typing import Callable, Optional

from stoker.producer.supervision.restart_policy import Death, RestartPolicy
from stoker.producer.supervision.worker_progress import WorkerProgress

log = logging.getLogger("stoker.producer")


class WorkerCrashLoop(RuntimeError):
    """Workers die in a way restarting cannot heal; the message names the cause and the fix."""


class WorkerSupervisor:
    """Workers ``0..workers-1`` started with ``start(w)``; ``procs`` is the live list (a dead worker waiting for its
    restart stays in it until then), so what reads it (metrics, the final join) sees every worker."""

    def __init__(self, start: Callable[[int], mp.process.BaseProcess], workers: int, progress: WorkerProgress,
                 policy: Optional[RestartPolicy] = None) -> None:
        self._start_process, self.progress = start, progress
        self.policy = policy or RestartPolicy(max_skipped=progress.capacity)
        self._due: dict[int, float] = {}  # worker -> when its delayed restart is due
        self.failure: Optional[str] = None  # why check() gave up (WorkerCrashLoop's message)
        self.procs: list[mp.process.BaseProcess] = [self._start(w) for w in range(workers)]

    def _start(self, worker: int) -> mp.process.BaseProcess:
        self.progress.restarting(worker)
        return self._start_process(worker)

    def alive(self) -> int:
        return sum(p.is_alive() for p in self.procs)

    def check(self, now: float) -> None:
        """Restart the workers found dead, or due after a delay; WorkerCrashLoop if the policy gives up."""
        for w, p in enumerate(self.procs):
            if w not in self._due:
                if p.is_alive():
                    continue
                ready, record, made, error = self.progress.of(w)
                decision = self.policy.on_death(Death(w, p.exitcode, ready, record, made, error))
                if decision.fatal is not None:
                    self.failure = decision.fatal
                    log.error("%s", decision.fatal)
                    raise WorkerCrashLoop(decision.fatal)
                if decision.skip is not None:
                    self.progress.skip(decision.skip)
                log.error("%s", decision.message)
                self._due[w] = now + decision.delay_s
            if now >= self._due[w]:
                del self._due[w]
                self.procs[w] = self._start(w)

    def join_or_kill(self) -> None:
        """Join the workers (told to stop) within 1.2 s together; kill any still alive."""
        deadline = time.monotonic() + 1.2
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(0.5)
