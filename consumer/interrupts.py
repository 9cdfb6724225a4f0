"""Make Ctrl-C work while the main thread is blocked inside a TensorFlow op.

Python runs signal handlers only between bytecodes, so a step waiting in a
queue dequeue would ignore Ctrl-C until data came. ``close_on_signal`` points
``signal.set_wakeup_fd`` at a pipe that a watcher thread reads: on SIGINT or
SIGTERM it closes the input, which cancels the blocked op, and the main thread
then raises KeyboardInterrupt as usual.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable, Iterator

_SENTINEL = 0  # no signal has number 0


@contextlib.contextmanager
def close_on_signal(close: Callable[[], None]) -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM call ``close()`` from a thread, then raise KeyboardInterrupt.

    Must be entered from the main thread (signal handlers live there).
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    previous_term = signal.signal(signal.SIGTERM, _raise_interrupt)

    def watch() -> None:
        while True:
            data = os.read(read_fd, 1)
            if not data or data[0] == _SENTINEL:
                return
            if data[0] in (signal.SIGINT, signal.SIGTERM):
                close()

    watcher = threading.Thread(target=watch, name="stoker-signal-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGTERM, previous_term)
        os.write(write_fd, bytes([_SENTINEL]))
        watcher.join(1.0)
        os.close(read_fd)
        os.close(write_fd)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")
