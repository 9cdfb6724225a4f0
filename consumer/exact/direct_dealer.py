"""Exact mode over our own ZMTP: a DEALER peer of one producer that reads batches into memory the sink owns.

A thread per producer connects (again every 0.1-1 s while refused, and after a drop), says
READY as a DEALER, then reads each message: a producer's status, or a batch held to the
trainer's spec by its header and read straight into ``empty()`` memory, as plain direct
receive does (``read_message``), so TensorFlow takes it without a copy. Messages wait in an
inbox for the control plane's thread (``receive``); a pipe is readable while any do, so one
``zmq.Poller`` waits on every link. The inbox is bounded: at ``batch_room`` batches (credit
keeps an honest producer below it) or ``status_room`` other messages (statuses, errors) the
thread stops reading, and TCP holds the producer back. A bad message is handed over as its ProtocolError (counted; in a
pool the producer starts afresh); a stream that cannot be followed is dropped and connected
again, and every new connection counts as a handshake (the control plane says hello on it).
``send`` never waits (``ZMTPConnection.send``); ``close`` gives queued messages ``linger_ms``
to leave and stops the thread, which ``join`` waits for (it is gone within about ``poll_s``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Callable, Optional

from stoker.protocol import DecodeLimits, ProtocolError
from stoker.protocol.batch_header import Batch
from stoker.protocol.batch_spec import BatchSpec

from stoker.consumer.receive.options import tcp_address
from stoker.consumer.transport.connections import ConnectionHealth
from stoker.consumer.transport.direct_receive import MAX_BACKOFF_S, EmptyArray, read_message
from stoker.consumer.transport.zmtp import SocketTypeMismatch, Stopped, ZMTPConnection

log = logging.getLogger("stoker.consumer")


class DirectDealer:
    """One exact-mode producer over our ZMTP; see the module doc. ValueError for an address that is not
    tcp://host:port. ``spec()`` is the trainer's batch spec once known (batches before it are refused)."""

    owned = True

    def __init__(self, address: str, spec: Callable[[], Optional[BatchSpec]], limits: DecodeLimits,
                 empty: EmptyArray, batch_room: int, status_room: int, poll_s: float = 0.1) -> None:
        tcp_address(address)
        self.address = address
        self._spec, self._limits, self._empty = spec, limits, empty
        self._batch_room, self._status_room, self._poll_s = batch_room, status_room, poll_s
        self.handshakes = 0
        self.health = ConnectionHealth()  # failed handshakes, mode-mismatch refusals, re-connects
        self._conn: Optional[ZMTPConnection] = None
        self._delivered = False
        self._changed = False
        self._inbox: deque[Batch | tuple[dict, int] | ProtocolError] = deque()
        self._batches = self._others = 0  # in the inbox: batches, and statuses or errors
        self._cond = threading.Condition()
        self._ready, self._ready_w = os.pipe()  # holds a byte exactly while the inbox holds a message
        os.set_blocking(self._ready, False)
        os.set_blocking(self._ready_w, False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stoker-exact-{address}", daemon=True)
        self._thread.start()

    # ---- for the control plane's thread ---------------------------------------------------------------

    @property
    def pollable(self) -> int:
        return self._ready

    @property
    def connected(self) -> set[str]:
        return {self.address} if self._conn is not None else set()

    def watch(self) -> bool:
        conn = self._conn
        if conn is not None:
            try:
                conn.flush()
            except OSError:
                pass  # the reader sees the connection end
        with self._cond:
            changed, self._changed = self._changed, False
        return changed

    def send(self, frame: bytes) -> bool:
        conn = self._conn
        if conn is None:
            return False
        try:
            conn.send(frame)
        except OSError:
            return False
        return True

    def receive(self) -> Batch | tuple[dict, int]:
        with self._cond:
            message = self._inbox.popleft()
            if not self._inbox:
                os.read(self._ready, 1)
            if isinstance(message, Batch):
                self._batches -= 1
            else:
                self._others -= 1
            self._cond.notify_all()
        if isinstance(message, ProtocolError):
            raise message
        return message

    def close(self, linger_ms: int) -> None:
        """Write what is queued (at least one try, then up to ``linger_ms``), then stop the thread without waiting
        for it (``join``)."""
        deadline = time.monotonic() + linger_ms / 1000
        conn = self._conn
        while conn is not None:
            try:
                conn.flush()
            except OSError:
                break
            if not conn.unsent or time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        with self._cond:
            self._stop.set()
            self._cond.notify_all()
            conn = self._conn
        if conn is not None:
            conn.shutdown()  # wakes the reader at once

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the thread (after ``close``); it closes the pipe on its way out."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("exact receive thread for %s still running after the stop", self.address)

    # ---- the reading thread -----------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self._stop.is_set()

    def _run(self) -> None:
        """Connect, read, connect again, until closed. Every failure is counted or reported, never raised."""
        backoff = self._poll_s
        try:
            while not self._stop.is_set():
                try:
                    delivered = self._connection()
                except Stopped:
                    return
                except Exception:  # never die silently: this producer would be lost to the job for good
                    log.exception("exact receive thread for %s failed; connecting again", self.address)
                    delivered = False
                backoff = self._poll_s if delivered else min(MAX_BACKOFF_S, backoff * 2)
                if self._stop.wait(backoff):
                    return
        finally:  # the control plane no longer polls a closed link: nothing reads or writes the pipe after this
            os.close(self._ready)
            os.close(self._ready_w)

    def _connection(self) -> bool:
        """One connection, from connecting to its end; whether it delivered. Stopped once closed."""
        try:
            conn = ZMTPConnection(self.address, self._stopping, self._poll_s, socket_type="DEALER")
        except (OSError, ProtocolError) as exc:  # refused, unreachable, not an exact producer: try again
            self._refused(exc)
            return False
        with self._cond:
            if self._stop.is_set():
                conn.close()
                raise Stopped()
            self._conn = conn
            self.handshakes += 1
            self.health.succeeded(self.address)
            self._changed = True
        self._delivered = False  # set by _read
        try:
            self._read(conn)
        except (OSError, ProtocolError) as exc:  # the peer went away, or its stream cannot be followed
            if self._stop.is_set():
                raise Stopped() from None
            log.info("exact connection to %s ended: %s", self.address, exc)
        finally:
            with self._cond:
                self._conn = None
                self._changed = True
            conn.close()
        self.health.reconnects += 1  # a connection that ended and will be made again
        return self._delivered

    def _refused(self, exc: BaseException) -> None:
        with self._cond:
            if isinstance(exc, ProtocolError) and \
                    self.health.failed(self.address, str(exc), isinstance(exc, SocketTypeMismatch)) == 1:
                log.warning("handshake with %s failed: %s", self.address, exc)
            self._changed = True

    def _read(self, conn: ZMTPConnection) -> None:
        """Messages into the inbox until the connection ends (raises) or the link closes (Stopped)."""
        while True:
            with self._cond:
                while self._batches >= self._batch_room or self._others >= self._status_room:
                    if self._stop.is_set():
                        raise Stopped()
                    self._cond.wait(self._poll_s)
            try:
                message: Batch | tuple[dict, int] | ProtocolError = read_message(
                    conn, self._spec(), self._limits, self._empty, statuses=True)
            except ProtocolError as exc:
                if not conn.in_sync:
                    self._post(exc)  # counted; the stream cannot be followed: drop it
                    raise
                message = exc
            self._post(message)
            self._delivered = True

    def _post(self, message: Batch | tuple[dict, int] | ProtocolError) -> None:
        with self._cond:
            self._inbox.append(message)
            if isinstance(message, Batch):
                self._batches += 1
            else:
                self._others += 1
            if len(self._inbox) == 1:
                os.write(self._ready_w, b"\0")
