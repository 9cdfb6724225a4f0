"""The trainer's side of exact mode: one DEALER link per producer, credit, sessions, consumed records, status.

Owned by ZMQInput's receive thread (links are not thread-safe, ``exact_links``), except
``record_consumed``, which steps call (from ``get()`` and the dataset) under a
lock, and ``snapshot``, which ``save_state`` calls.

- Before ``activate()`` the transport only asks producers to ``describe``
  themselves (status and batch spec) and receives nothing: a checkpoint's state can
  still be restored. After it, every new connection (a producer started or
  restarted) gets a ``hello`` with a fresh session, this trainer's whole input
  state and the records it holds from that producer; batches sent under an older
  session are dropped (their records are served again by the new incarnation).
- Each batch queued earns one credit back, sent in steps of half the window;
  consumed records (``record_consumed``) go to the producer they came from with
  the next credit. Neither waits longer than ``REPORT_WAIT_S`` (0.1 s); a
  heartbeat goes every 0.5 s without other traffic, also while the queue is
  full, so a slow step is never taken for dead.
- ``finished`` once every producer said it finished its epochs.
- ``check_stalls()`` (every turn): a producer holding work that sent nothing new for the stall bound
  while this trainer's queue had room is named. In an elastic pool its splits go to the others
  (``split_scheduler``); a fixed shard cannot be served by anyone else, so the warning repeats at a
  growing interval and, past ``stall_limit``, the input fails naming the producer and the fix.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Callable, Optional, Sequence

import numpy as np
import zmq

from stoker.protocol.batch_codec import Batch
from stoker.protocol.exact_messages import (MAX_WORK_ITEMS, Credit, Hello, Records, Status, Work, decode_status,
                                            encode_credit, encode_describe, encode_hello, encode_work)
from stoker.protocol.batch_spec import BatchMismatchError, BatchSpec
from stoker.protocol.input_state import InputState, StreamKey, rows_by_epoch

from stoker.consumer.transport.connections import HandshakeFailures
from stoker.consumer.exact.links import Link
from stoker.consumer.exact.split_scheduler import STALL_AFTER_S, SplitScheduler, split_records, splits_ahead

log = logging.getLogger("stoker.consumer")

HEARTBEAT_S = 0.5
#: How long consumed records may wait for a credit to carry them before they go alone: a message per step
#: would double the control traffic (and the wake-ups on both sides) for nothing.
REPORT_WAIT_S = 0.1
DESCRIBE_RETRY_S = 1.0
#: Default of ``stall_limit`` (``--stall-limit``): a fixed-shard producer stuck this long fails the input.
STALL_LIMIT_S = 300.0
_STALL_CHECK_S = 0.25
_PAUSE_S = 1.0  # a gap this long between two stall checks: the trainer itself was paused


class ExactTransport:
    """See the module doc. ``connect(address)`` makes a producer's link (ValueError for a bad address);
    ``state``: the consumed records this trainer starts from (a restored checkpoint)."""

    def __init__(self, connect: Callable[[str], Link], addresses: Sequence[str], trainer_id: str, state: InputState,
                 credit: int, share: tuple[int, int] = (0, 1), stall_after: Optional[float] = STALL_AFTER_S,
                 stall_limit: Optional[float] = STALL_LIMIT_S) -> None:
        self.trainer_id, self.credit = trainer_id, credit
        # An elastic pool (producers with --shard auto): this trainer hands out the splits of its share.
        self.splits: Optional[SplitScheduler] = None
        self.batch_size = 64  # the receiver sets it from the spec; splits are whole batches
        self.stall_after, self.stall_limit = stall_after, stall_limit
        self.stall_error: Optional[str] = None  # set once a fixed-shard producer stayed stuck past stall_limit
        self.stall_warnings = 0  # warnings that a fixed-shard producer sends nothing (repeated, growing apart)
        self._stalls_checked = 0.0
        self._queue_full_at = float("-inf")
        self.share = share
        self._pooled: set[int] = set()  # producers serving this trainer's splits under the current session
        self._stuck: set[int] = set()  # producers taken for stuck, told to start afresh, not answered yet
        self._refused_pool: set[str] = set()
        self._told_finished: set[tuple[int, int]] = set()  # (producer, session) told the run is complete
        self.expected_spec: Optional[BatchSpec] = None  # the receiver's: a pool producer must send these batches
        self._warned_share = False
        self._connect = connect
        # Per producer connection, by its number (``stoker_source``), which stays its own after it leaves the pool.
        self.addresses: list[str] = []
        self.links: list[Optional[Link]] = []  # None: it left the pool
        self.active = False
        self.session: list[int] = []
        self._said_hello: list[int] = []  # handshakes seen when the last hello went out
        self.stream: list[str] = []
        self.status: list[Optional[Status]] = []
        self.stale_batches = 0
        self._poller = zmq.Poller()  # the live sockets (made once: zmq.select would build one per call)
        self._number: dict[object, int] = {}  # a link's pollable -> its number
        self._lock = threading.Lock()
        self._state = state
        self._held: list[dict[int, set[int]]] = []  # epoch -> indices
        self._reports: list[list[tuple[np.ndarray, np.ndarray]]] = []  # (epochs, indices) consumed, unsent
        self._reported_at: list[float] = []  # when the oldest unsent report was made
        self._owed: list[int] = []  # credit earned, not sent yet (receive thread only)
        self._owed_at: list[float] = []
        self._last_sent: list[float] = []
        self._described_at: list[float] = []
        self._heard_at: list[float] = []  # any message (batch or status) from it
        self._batch_at: list[float] = []  # a batch of the current session, or the hello that began it
        self._stall_warned: list[tuple[float, float]] = []  # (next warning at, interval), while stuck
        self._read_turn: list[int] = []  # when each was last read (a turn count): poll() serves the oldest first
        self._turn = 0
        #: control messages sent and received, and their bytes (the receive thread writes them)
        self.control = [0, 0, 0, 0]
        try:
            for address in addresses:
                self.add(address)
        except ValueError:
            self.close()
            raise

    def add(self, address: str) -> int:
        """Connect to one more producer (it joined the pool); its number. ValueError for a bad address."""
        link = self._connect(address)
        with self._lock:
            self.addresses.append(address)
            self.links.append(link)
            self._poller.register(link.pollable, zmq.POLLIN)
            self._number[link.pollable] = len(self.links) - 1
            self.session.append(0)
            self._said_hello.append(0)
            self.stream.append("")
            self.status.append(None)
            self._held.append(defaultdict(set))
            self._reports.append([])
            self._reported_at.append(0.0)
            self._owed.append(0)
            self._owed_at.append(0.0)
            self._last_sent.append(0.0)
            self._described_at.append(-DESCRIBE_RETRY_S)
            now = time.monotonic()
            self._heard_at.append(now)
            self._batch_at.append(now)
            self._stall_warned.append((0.0, 0.0))
            self._read_turn.append(0)
        return len(self.links) - 1

    def remove(self, address: str) -> Optional[int]:
        """Disconnect from a producer that left the pool; its number (None if unknown). Batches of it that are
        queued stay valid; what it had not sent is served by others (a shard's own producer comes back, splits
        are handed out again)."""
        for i, known in enumerate(self.addresses):
            link = self.links[i]
            if known == address and link is not None:
                self._poller.unregister(link.pollable)
                del self._number[link.pollable]
                link.close(linger_ms=0)
                link.join(1.0)
                self.links[i] = None
                self.status[i] = None
                self._leave_pool(i)
                return i
        return None

    def live(self) -> list[int]:
        """The numbers of the producers in the pool now."""
        return [i for i, link in enumerate(self.links) if link is not None]

    # ---- state ------------------------------------------------------------------------------

    def snapshot(self) -> InputState:
        """A copy of the records consumed so far (what a checkpoint saves)."""
        with self._lock:
            return self._state.copy()

    def restore(self, state: InputState) -> None:
        if self.active:
            raise RuntimeError("restore the input state before the first get() / as_dataset() / start(): after "
                               "that, batches chosen under the old state may already be queued")
        with self._lock:
            self._state = state

    def record_consumed(self, source: int, epochs: np.ndarray, indices: np.ndarray, mask: np.ndarray) -> None:
        """Rows a step was given (called from the step; any thread)."""
        if source < 0:
            return  # a terminator: no records
        rows = mask.astype(bool)
        epochs, indices = epochs[rows].astype(np.int64), indices[rows].astype(np.int64)
        with self._lock:
            stream = self.stream[source]
            if stream:
                self._state.mark(stream, epochs, indices)
            held = self._held[source]
            for e, of_epoch in rows_by_epoch(epochs):
                held[e].difference_update(indices[of_epoch].tolist())
            if not self._reports[source]:
                self._reported_at[source] = time.monotonic()
            self._reports[source].append((epochs, indices))
            if self.splits is not None and stream == str(self.splits.key):
                self.splits.consumed(epochs, indices)

    # ---- connections ------------------------------------------------------------------------

    def activate(self) -> None:
        self.active = True

    def watch(self) -> bool:
        """Handle monitor events; say hello on new connections once active. True if anything changed."""
        changed = False
        for i in self.live():
            link = self.links[i]
            assert link is not None
            changed |= link.watch()
            if i in self._pooled and not link.connected:
                self._leave_pool(i)  # gone (killed, cut off): its splits go to the others; back, it says hello
            handshakes = link.handshakes  # before the hello: a connection made meanwhile gets its own
            if self.active and handshakes > self._said_hello[i]:
                self._hello(i)
                self._said_hello[i] = handshakes
            if not self.active and self.status[i] is None and link.connected \
                    and time.monotonic() - self._described_at[i] >= DESCRIBE_RETRY_S:
                self._send(i, encode_describe())  # asked again until answered: a request is never taken as delivered
                self._described_at[i] = time.monotonic()
        return changed

    def _hello(self, i: int) -> None:
        self._leave_pool(i)  # a new session: what it was asked to serve before is void
        self.session[i] += 1
        with self._lock:
            state = self._state.copy()
            held: dict[str, Records] = {}
            if self.stream[i]:
                held[self.stream[i]] = [(e, sorted(ix)) for e, ix in self._held[i].items() if ix]
            self._reports[i] = []  # the hello's state includes them
        self._owed[i] = 0  # and it gives the whole credit afresh
        self._batch_at[i] = time.monotonic()
        self._send(i, encode_hello(Hello(self.trainer_id, self.session[i], self.credit, state, held)))

    def _send(self, i: int, frame: bytes) -> bool:
        """Whether ``frame`` went out (False: not connected, and the next connection says hello)."""
        link = self.links[i]
        if link is None or not link.send(frame):
            return False  # it left the pool, or is not connected
        self._last_sent[i] = time.monotonic()
        self.control[0] += 1
        self.control[1] += len(frame)
        return True

    def flush(self, force: bool = False) -> None:
        """Send consumed records and credit that waited long enough (``force``: all of them, e.g. when the
        input stops), and heartbeats where nothing went out for a while."""
        if not self.active:
            return
        now = time.monotonic()
        for i in self.live():
            if self.session[i] == 0:
                continue  # no hello yet
            # Reports and credit wait for each other up to REPORT_WAIT_S (unless forced); a heartbeat goes anyway.
            with self._lock:
                reports_due = bool(self._reports[i]) and (force or now - self._reported_at[i] >= REPORT_WAIT_S)
            credit_due = self._owed[i] > 0 and (force or now - self._owed_at[i] >= REPORT_WAIT_S)
            if reports_due or credit_due or now - self._last_sent[i] >= HEARTBEAT_S:
                self._credit(i)
        self._give_work_all()
        if now - self._stalls_checked >= _STALL_CHECK_S:
            if now - self._stalls_checked > _PAUSE_S:
                self.queue_full()  # this thread did not run (a paused trainer, a GC): nobody else's silence
            self._stalls_checked = now
            self.stall_error = self.check_stalls(now) or self.stall_error

    def _give_back(self, i: int) -> None:
        """One credit back to producer ``i`` (a batch of it was queued or dropped). Credit goes in steps of half
        the window: a message per batch would be most of the control traffic and of both sides' wake-ups; what
        is held back goes with the next flush after ``REPORT_WAIT_S`` at the latest."""
        if not self._owed[i]:
            self._owed_at[i] = time.monotonic()
        self._owed[i] += 1
        if self._owed[i] >= max(1, self.credit // 2):
            self._credit(i)

    def _credit(self, i: int) -> None:
        """Send the credit owed to producer ``i`` and the records consumed since the last message (either may be
        none: then it is a heartbeat)."""
        with self._lock:
            reports, self._reports[i] = self._reports[i], []
        n, self._owed[i] = self._owed[i], 0
        consumed: Records = []
        if reports:
            epochs = np.concatenate([e for e, _ in reports])
            indices = np.concatenate([ix for _, ix in reports])
            consumed = [(e, indices[rows].tolist()) for e, rows in rows_by_epoch(epochs)]
        if not self._send(i, encode_credit(Credit(self.session[i], n, consumed))):
            # Kept for the next message (a connection that stays up with a full send pipe); a new connection's
            # hello resets both (it carries the whole state and credit).
            self._owed[i] += n
            with self._lock:
                self._reports[i] = reports + self._reports[i]

    # ---- data -------------------------------------------------------------------------------

    def poll(self, timeout_ms: int) -> list[int]:
        """The producers with a message waiting, after at most ``timeout_ms``, the one read longest ago first: a
        receiver with room for one batch per turn (a slow step) reads each producer in turn, never the first
        registered alone (which starved the others and made them look stuck)."""
        if not self._number:
            time.sleep(timeout_ms / 1000)
            return []
        ready = [self._number[sock] for sock, _ in self._poller.poll(timeout_ms)]
        return sorted(ready, key=self._read_turn.__getitem__)

    def owned(self, i: int) -> bool:
        """Whether producer ``i``'s batches arrive in memory the sink may own (``exact_links``)."""
        link = self.links[i]
        return link is not None and link.owned

    def receive(self, i: int) -> Optional[Batch]:
        """A batch from producer ``i`` (not yet held to the spec), or None (a status, handled here).
        ProtocolError for a bad message."""
        link = self.links[i]
        assert link is not None
        self._turn += 1
        self._read_turn[i] = self._turn
        message = link.receive()
        if isinstance(message, Batch):
            return message
        self._heard_at[i] = time.monotonic()
        body, nbytes = message
        status = decode_status(body)  # ProtocolError propagates: counted as a rejected message
        self.control[2] += 1
        self.control[3] += nbytes
        self.status[i] = status
        if self.active and status.stranger and self.session[i] > 0:
            # It answers credit or work of ours with "who are you": it dropped this trainer (silent past its
            # --trainer-timeout) or restarted unseen. Say hello again, or nothing would come from it for ever.
            log.warning("producer %s no longer knows this trainer: saying hello again", status.producer)
            link = self.links[i]
            handshakes = link.handshakes if link is not None else 0  # before the hello, as in watch()
            self._hello(i)
            self._said_hello[i] = handshakes
            return None
        if status.stream:
            with self._lock:
                self.stream[i] = status.stream
                if status.session == self.session[i] and status.session and status.stream in self._state.streams:
                    # Epochs the producer completed (every trainer consumed them): their bitmaps need not be kept,
                    # so a long run's state stays a few bitmaps, not one per epoch ever trained.
                    self._state.streams[status.stream].advance(status.completed)
        if status.stream.startswith("splits:") and status.session == self.session[i] and status.session:
            self._join_pool(i, status)
        elif status.stream and self.share[1] > 1 and not self._warned_share:
            self._warned_share = True
            log.warning("share %d/%d applies to elastic pools (producers --shard auto); producer %s serves the "
                        "fixed shard %s, so this trainer takes what its credit earns", *self.share, status.producer,
                        status.stream)
        return None

    def accept(self, i: int, stream: str, session: int) -> bool:
        """Whether a batch sent under ``session`` counts (not one of an older session, or before any hello)."""
        if session != self.session[i] or self.session[i] == 0:
            self.stale_batches += 1
            return False
        self._batch_at[i] = time.monotonic()
        if stream and stream != self.stream[i]:
            with self._lock:
                self.stream[i] = stream
        return True

    def queued(self, i: int, epochs: np.ndarray, indices: np.ndarray, mask: np.ndarray) -> None:
        """A batch from producer ``i`` entered the queue: its records are held here; one credit back."""
        rows = mask.astype(bool)
        epochs, indices = epochs[rows], indices[rows]
        with self._lock:
            held = self._held[i]
            for e, of_epoch in rows_by_epoch(epochs):
                held[e].update(indices[of_epoch].tolist())
        self._give_back(i)

    # ---- an elastic pool ---------------------------------------------------------------------

    def _join_pool(self, i: int, status: Status) -> None:
        """Producer ``i`` serves an elastic pool: hand it splits (the first such producer defines the pool)."""
        if i in self._pooled:
            return
        with self._lock:
            if self.splits is None:
                key = StreamKey.parse(status.stream)
                split = split_records(key.records, self.batch_size, self.share[1])
                self.splits = SplitScheduler(key, self._state.progress(status.stream), status.epochs,
                                             split, *self.share, ahead=splits_ahead(split, self.batch_size, self.credit),
                                             stall_after=self.stall_after)
                log.info("elastic pool of %d records (seed %d): handing out splits of %d records (%d an epoch)%s",
                         key.records, key.seed, split, self.splits.splits, f", share {self.share[0]}/{self.share[1]}"
                         if self.share[1] > 1 else "")
            why = ""
            if status.stream != str(self.splits.key) or status.epochs != self.splits.epochs:
                why = (f"serves {status.stream} ({status.epochs} epochs) but this trainer's pool is {self.splits.key} "
                       f"({self.splits.epochs} epochs); start every producer of a pool on the same dataset with the "
                       "same --seed and --epochs")
            elif self.expected_spec is not None and status.spec:
                try:
                    self.expected_spec.check_declared(status.producer, status.spec)
                except BatchMismatchError as exc:
                    why = str(exc)
            if why:
                if status.producer not in self._refused_pool:
                    self._refused_pool.add(status.producer)
                    log.error("producer %s gets no work: %s", status.producer, why)
                return
        self._pooled.add(i)
        if i in self._stuck:
            self._stuck.discard(i)
            log.warning("elastic pool: producer %s answers again: it takes new work", self.name(i))
        self._give_work(i)  # new to the scheduler: its first top-up makes it known
        self._give_work_all()

    def _leave_pool(self, i: int) -> None:
        if i in self._pooled:
            self._pooled.discard(i)
            with self._lock:
                assert self.splits is not None
                released = self.splits.release(i)
            if released:
                log.info("producer %s left or restarted: %d unfinished split(s) go to the others",
                         self.addresses[i], released)

    def _give_work_all(self) -> None:
        """Top up every pooled producer, those holding the fewest splits first: when splits are scarce (the
        window's end, a small dataset) a producer that joined takes the next free one."""
        if not self._pooled:
            return
        with self._lock:
            assert self.splits is not None
            order = list(self._pooled) if self.splits.finished else \
                [i for i in self.splits.wants_work() if i in self._pooled]
        for i in order:
            self._give_work(i)

    def _give_work(self, i: int) -> None:
        with self._lock:
            assert self.splits is not None
            if self.splits.finished:
                items, finished = [], True
            else:
                items, finished = self.splits.top_up(i), False
        if finished and (i, self.session[i]) not in self._told_finished:
            self._told_finished.add((i, self.session[i]))
            self._send(i, encode_work(Work(self.session[i], [], finished=True)))
        elif items:
            for start in range(0, len(items), MAX_WORK_ITEMS):
                self._send(i, encode_work(Work(self.session[i], items[start:start + MAX_WORK_ITEMS])))

    def arrived(self, i: int, stream: str, epochs: np.ndarray, indices: np.ndarray,
                mask: np.ndarray) -> Optional[np.ndarray]:
        """An elastic pool's batch: the rows to keep (new records of this trainer's share); None for fixed shards.

        Every batch of a pool's stream goes through the scheduler, also one from a producer that was just
        taken for gone: what it sends may still be new, and what is not is dropped."""
        if not stream.startswith("splits:"):
            return None
        with self._lock:
            if self.splits is None or stream != str(self.splits.key):
                return np.zeros(len(indices), bool)  # no pool of this trainer's: nothing of it is asked for
            keep = self.splits.arrived(epochs, indices, mask, producer=i)
        self._give_work_all()
        return keep

    def queue_full(self) -> None:
        """The trainer's queue is full: producers wait for credit, which is not a stall of theirs."""
        self._queue_full_at = time.monotonic()
        if self.splits is not None:
            with self._lock:
                self.splits.queue_full(self._queue_full_at)

    def name(self, i: int) -> str:
        """Producer ``i`` as a person finds it: its id (from its status) and the address we connect to."""
        status = self.status[i]
        return f"{status.producer} at {self.addresses[i]}" if status is not None else self.addresses[i]

    def check_stalls(self, now: Optional[float] = None) -> Optional[str]:
        """Name producers that hold work and send nothing new (see the module doc); the error to fail the input
        with once a fixed-shard producer stayed stuck past ``stall_limit`` (else None)."""
        now = time.monotonic() if now is None else now
        if self.splits is not None:
            with self._lock:
                stuck = self.splits.stalls(now)
            for producer, silent, held in stuck:
                log.warning("elastic pool: producer %s sent no new record for %.0f s while this trainer waited "
                            "(stall bound %.1f s); its %d record(s) go to the other producers. It gets no new work "
                            "until it answers again", self.name(producer), silent, self.splits.stall_bound(), held)
                # A new session: the producer drops what it queued for us (it would make it for nothing) and rejoins
                # the pool when it answers; batches it made before are stale and dropped.
                self._stuck.add(producer)
                link = self.links[producer]
                handshakes = link.handshakes if link is not None else 0
                self._hello(producer)
                self._said_hello[producer] = handshakes
            if stuck:
                self._give_work_all()
        if self.stall_after is None or not self.active:
            return None
        live = self.live()
        # The two latest batches: "others moved on" for producer i is the latest that is not its own.
        latest = sorted(((self._batch_at[j], j) for j in live), reverse=True)[:2]
        for i in live:
            status, link = self.status[i], self.links[i]
            # Idle (its epochs wait for trainers to consume them), said lately and since its last batch: not stuck.
            idle = status is not None and status.idle and now - self._heard_at[i] <= self.stall_after
            if i in self._pooled or self.session[i] == 0 or status is None or status.stream.startswith("splits:") \
                    or status.finished or status.waiting > 0 or idle or link is None or not link.connected:
                self._batch_at[i] = now  # not waited on now: its silence counts from when it is again
                self._stall_warned[i] = (0.0, self._stall_warned[i][1])
                continue
            # A full queue excuses silence (credit, not the producer, holds it back) unless others moved on meanwhile.
            others = next((t for t, j in latest if j != i), float("-inf"))
            excuse = self._queue_full_at if others - self._batch_at[i] <= self.stall_after else float("-inf")
            silent = now - max(self._batch_at[i], excuse)
            if silent <= self.stall_after:
                # The interval is kept: a producer that stalls again and again is not named at every stall.
                self._stall_warned[i] = (0.0, self._stall_warned[i][1])
                continue
            next_at, interval = self._stall_warned[i]
            if now >= next_at:
                self.stall_warnings += 1
                heard = now - self._heard_at[i]
                log.warning("producer %s sent no batch for %.0f s while this trainer waited for data (%s); a fixed "
                            "shard (%s, %s) cannot be served by another producer, so its records wait for it. "
                            "Restart it (it resumes the open epochs), or run the job as an elastic pool (producers "
                            "--shard auto). %s", self.name(i), silent,
                            f"its last message came {heard:.0f} s ago" if heard > 1 else
                            "it is alive, but neither its workers nor its epochs move on", status.stream,
                            self._open_epochs(status.stream),
                            f"This trainer fails in {max(0.0, self.stall_limit - silent):.0f} s (stall_limit)"
                            if self.stall_limit is not None else "stall_limit is off: this trainer waits")
                interval = max(self.stall_after, 2 * interval)
                self._stall_warned[i] = (now + interval, interval)
            if self.stall_limit is not None and silent > self.stall_limit:
                return (f"producer {self.name(i)} sent no batch for {silent:.0f} s (stall_limit={self.stall_limit:g}) "
                        f"while this trainer waited; its fixed shard {status.stream} cannot be served by another "
                        f"producer ({self._open_epochs(status.stream)}). Restart that producer and this trainer from "
                        "its last checkpoint, or run the job as an elastic pool (producers --shard auto), where "
                        "other producers take a stuck one's work")
        return None

    def _open_epochs(self, stream: str) -> str:
        """What this trainer still waits for from a fixed shard: records of its open epochs not consumed."""
        with self._lock:
            progress = self._state.streams.get(stream)
            try:
                count = StreamKey.parse(stream).size
            except ValueError:
                return "epochs unknown"
            if progress is None:
                return f"all {count} records of its first epoch to come"
            epoch = progress.completed
            bitmap = progress.open.get(epoch)  # not consumed(): that would open the epoch in the state
            left = count - (int(bitmap.sum()) if bitmap is not None else 0)
            return f"{left} of {count} records of epoch {epoch} not consumed yet"

    def waiting_report(self) -> list[str]:
        """One line per producer for a trainer that waits for data: connected, session, credit owed, last batch
        age, what it holds of an elastic pool's work."""
        now = time.monotonic()
        lines = []
        for i in self.live():
            link, status = self.links[i], self.status[i]
            connected = bool(link is not None and link.connected)
            what = f"{self.name(i)}: {'connected' if connected else 'NOT connected'}"
            what += f", session {self.session[i]}" if self.session[i] else ", no hello yet"
            what += f", last batch {now - self._batch_at[i]:.1f} s ago, last message {now - self._heard_at[i]:.1f} s ago"
            if self.splits is not None and i in self._pooled:
                with self._lock:
                    what += (f", holds {self.splits.holding(i)} split(s) ({self.splits.records_held(i)} records)"
                             + (" STUCK" if i in self.splits.stuck else ""))
            elif status is not None and status.stream:
                what += f", serves {status.stream}: {self._open_epochs(status.stream)}"
                if status.waiting:
                    what += f", waits for {status.waiting} more trainer(s)"
            lines.append(what)
        if self.splits is not None:
            with self._lock:
                lines.append(f"elastic pool: epochs open {sorted(self.splits.open)}, "
                             f"{sum(e.left for e in self.splits.open.values())} record(s) of them not consumed")
        return lines

    def pool_counters(self) -> tuple[int, int, int, int]:
        """``(splits re-served from stuck producers, backup splits, wasted records, producers taken for stuck)``."""
        sched = self.splits
        if sched is None:
            return 0, 0, 0, 0
        return sched.reserved, sched.backups, sched.duplicates, sched.stalls_seen

    def rejected(self, i: int) -> None:
        """A batch from producer ``i`` was rejected (undecodable, wrong spec): in a pool its records would never
        arrive, so it starts afresh (a new session: its splits go back and its credit is whole again)."""
        if i in self._pooled:
            self._hello(i)

    def dropped(self, i: int) -> None:
        """A batch from producer ``i`` was not queued (nothing new in it): its credit comes back."""
        self._give_back(i)

    @property
    def finished(self) -> bool:
        if self.splits is not None:
            return self.splits.finished
        live = self.live()
        return bool(live) and all(self.status[i] is not None and self.status[i].finished for i in live)  # type: ignore[union-attr]

    def spec(self) -> Optional[list[tuple[str, str, list[int]]]]:
        """The batch spec a producer described (the first that did), or None yet."""
        for status in self.status:
            if status is not None and status.spec:
                return status.spec
        return None

    def close(self) -> None:
        # What the last flush queued (a finished pool's "finished", the last steps' records) gets up to 0.5 s to
        # leave, all links together: a libzmq close returns at once (the context's term waits), a direct link's
        # waits for its own queue, so each gets what is left of one deadline.
        deadline = time.monotonic() + (0.5 if self.active else 0.0)
        links = self.live_links()
        for link in links:
            link.close(linger_ms=max(0, int((deadline - time.monotonic()) * 1000)))
        deadline = time.monotonic() + 1.0
        for link in links:
            link.join(max(0.0, deadline - time.monotonic()))

    def live_links(self) -> list[Link]:
        return [link for link in self.links if link is not None]

    def connected(self) -> set[str]:
        return set().union(*(link.connected for link in self.live_links()))

    def failures(self) -> tuple[int, str, str]:
        """``(count, endpoint, reason)`` of failed handshakes over the producers in the pool."""
        links = self.live_links()
        if not links:
            return 0, "", ""
        last: HandshakeFailures = max((link.failures for link in links), key=lambda f: f.count)
        return sum(link.failures.count for link in links), last.endpoint, last.reason
