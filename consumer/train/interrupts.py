"""Make Ctrl-C work while the main thread is blocked inside a TensorFlow op.

Python runs signal handlers only between bytecodes, so a step waiting in a
queue dequeue would ignore Ctrl-C until data came. ``close_on_signal`` points
``signal.set_wakeup_fd`` at a pipe that a watcher thread reads: on SIGINT or
SIGTERM it closes the input, which cancels the blocked op. The Python-level
handler only records the signal (raising inside TensorFlow's C++ boundary
would garble the exception); leaving the block raises KeyboardInterrupt.

With a ``grace``, the first signal only sets the event for that long, so a loop that checks it
between steps ends after a whole step (and can save a checkpoint) rather than in the middle of one;
the input is closed when the grace is over (a step blocked waiting for data is cancelled then), or
at once on a second signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable, Iterator

_SENTINEL = 0  # no signal has number 0
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def close_on_signal(close: Callable[[], None], grace: float = 0.0) -> Iterator[threading.Event]:
    """Within the block, SIGINT/SIGTERM call ``close()``, ``grace`` seconds after the first signal or at once on a
    second; the block then ends in KeyboardInterrupt.

    Must be entered from the main thread. Yields the Event that records the signal.
    """
    interrupted = threading.Event()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    previous = {sig: signal.signal(sig, lambda *_: interrupted.set()) for sig in _SIGNALS}

    timer = threading.Timer(grace, close)
    timer.daemon = True

    def watch() -> None:
        signals = 0  # counted here: the Python-level handler sets the event too, maybe first
        while True:
            data = os.read(read_fd, 1)
            if not data or data[0] == _SENTINEL:
                return
            if data[0] in _SIGNALS:
                interrupted.set()
                signals += 1
                if grace > 0 and signals == 1:
                    timer.start()
                else:
                    close()

    watcher = threading.Thread(target=watch, name="stoker-signal-watch", daemon=True)
    watcher.start()
    try:
        yield interrupted
    except Exception:
        if interrupted.is_set():
            raise KeyboardInterrupt("interrupted by signal") from None
        raise
    finally:
        timer.cancel()
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.write(write_fd, bytes([_SENTINEL]))
        watcher.join(1.0)
        os.close(read_fd)
        os.close(write_fd)
    if interrupted.is_set():
        raise KeyboardInterrupt("interrupted by signal")
