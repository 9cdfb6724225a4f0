"""How a long-running command is stopped: by SIGTERM/SIGINT (``stoker produce``, ``lmdb upload``), or because the
process that launched it is gone (``produce --parent-pid``)."""

from __future__ import annotations

import logging
import signal
import threading


def stop_event_on_signals() -> threading.Event:
    """An Event set by SIGTERM or SIGINT, so a long-running command can shut down cleanly (every wait of it,
    storage's retries included, watches the event). A second signal raises KeyboardInterrupt: a person who asks
    twice is not kept waiting by anything that missed the first."""
    stop = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            logging.getLogger("stoker").warning("received %s again: stopping now", name)
            raise KeyboardInterrupt(name)
        logging.getLogger("stoker").info("received %s, shutting down", name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def stop_with_process(pid: int, stop: threading.Event, every_s: float = 0.5) -> threading.Thread:
    """Set ``stop`` once process ``pid`` is gone (checked every ``every_s``): a daemon started by a
    launcher that is killed outright (SIGKILL, an OOM kill) shuts down instead of serving for ever."""
    from stoker.producer.measure.procfs import running

    def watch() -> None:
        while not stop.wait(every_s):
            if not running(pid):  # gone, or a zombie: killed and not yet reaped by its own parent
                logging.getLogger("stoker").warning("process %d that started this one is gone: shutting down", pid)
                stop.set()

    thread = threading.Thread(target=watch, name="stoker-parent-watch", daemon=True)
    thread.start()
    return thread
