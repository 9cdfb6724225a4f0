"""A straggler made to order, for tests and benchmarks: a producer daemon paused and resumed in turn.

On ``ProducerProcess.pause``/``resume`` (SIGSTOP/SIGCONT of the daemon and its workers): its connections stay up,
it just sends less, as a host short of CPU or on a slow disk would.
"""

from __future__ import annotations

import threading

from stoker.producer.process import ProducerProcess


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
