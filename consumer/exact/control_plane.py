"""The trainer's side of exact mode: one DEALER link per producer, credit, sessions, consumed records, status.

Owned by the input's receive thread, whatever the facade (links are not thread-safe, ``links``), except
``record_consumed``, which steps call (from ``get()`` and the dataset) under the ledger's
lock. The consumed records and the trainer id belong to the ``ConsumedLedger`` (``ledger``),
which the facades save and restore; this control plane reads it and asks the ledger to mark it, under that lock.
What it knows of each producer is one ``KnownProducer`` record (``producers``, by number), kept
with its link by ``ProducerLinks``, which also sends credit, reports and heartbeats.

- Before ``activate()`` the control plane only asks producers to ``describe``
  themselves (status and batch spec) and receives nothing: a checkpoint's state can
  still be restored. After it, every new connection (a producer started or
  restarted) gets a ``hello`` with a fresh session, the progress of the stream it serves
  alone (``hello_state``; asked to describe itself first while that is unknown) and the records
  this trainer holds from it; batches sent under an older session are dropped (their records
  are served again by the new incarnation).
- Each batch queued earns one credit back, sent in steps of half the window;
  consumed records (``record_consumed``) go to the producer they came from with
  the next credit. Neither waits longer than ``REPORT_WAIT_S`` (0.1 s, ``producers``); heartbeats (without
  other traffic, also while the queue is full: a slow step is never taken for dead) and the statuses a hello
  asks for are spaced by the liveness rules (``attention``: 0.5-2 s, 1-2.5 s).
- An elastic pool (producers ``--shard auto``) is handed out by this trainer (``pool_work``), through its
  ``PoolSeat`` (``pool_seat``, empty without a pool): its scheduler is made when the first pool producer
  reports, from what ``configure(spec)`` and the constructor gave; one reporting before ``configure`` joins then.
- ``finished`` once every producer said it finished its epochs (a pool: once its epochs are consumed).
- ``close()`` says goodbye to each producer it has a session with (if its status says it takes one),
  after the last steps' records: the producer serves what this trainer held to the others at once and
  logs that it left, where a trainer that vanishes is found unreachable or silent (a WARNING).
- ``check_stalls()`` (every quarter second): a producer holding work that sent nothing new for the
  stall bound while this trainer's queue had room is named. In an elastic pool its splits go to the
  others (``pool_work``); a fixed shard cannot be served by anyone else (``shard_stalls``), so the
  warning repeats at a growing interval and, past ``stall_limit``, the input fails naming the
  producer and the fix.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

import numpy as np

from stoker.protocol.batch_header import Batch
from stoker.protocol.exact_messages import Hello, decode_status, encode_describe
from stoker.protocol.batch_spec import BatchSpec
from stoker.protocol.input_state import StreamKey

from stoker.consumer.exact.hello_state import hello_again, hello_state, knows_stream, serves_another_stream
from stoker.consumer.exact.ledger import ConsumedLedger

from stoker.consumer.exact.links import Link
from stoker.consumer.exact.pool.pool_seat import PoolSeat
from stoker.consumer.exact.pool.pool_work import serves_pool
from stoker.consumer.exact.producers import KnownProducer, ProducerLinks
from stoker.consumer.exact.shard_stalls import ShardStallWatch, open_epochs, shard_waiting
from stoker.consumer.exact.pool.split_plan import SchedulerPlan
from stoker.consumer.exact.pool.split_scheduler import SplitScheduler
from stoker.consumer.receive.options import STALL_AFTER_S, STALL_LIMIT_S

log = logging.getLogger("stoker.consumer")

__all__ = ["ExactControlPlane"]

DESCRIBE_RETRY_S = 1.0
_STALL_CHECK_S = 0.25
_PAUSE_S = 1.0  # a gap this long between two stall checks: the trainer itself was paused


class ExactControlPlane:
    """See the module doc. ``connect(address)`` makes a producer's link (ValueError for a bad address); ``credit``:
    batches each producer may send ahead; ``share``: ``(rank, world)``, this trainer's splits of an elastic pool;
    ``stall_after`` / ``stall_limit``: seconds before a producer that sends nothing is named / fails the input."""

    def __init__(self, connect: Callable[[str], Link], addresses: Sequence[str], ledger: ConsumedLedger,
                 credit: int, share: tuple[int, int] = (0, 1), stall_after: Optional[float] = STALL_AFTER_S,
                 stall_limit: Optional[float] = STALL_LIMIT_S) -> None:
        self.ledger, self.credit, self.share, self.stall_after = ledger, credit, share, stall_after
        ledger.attach(self.record_consumed)
        self._lock = ledger.lock  # one lock for the ledger's records and what this control plane derives from them
        self.links = links = ProducerLinks(connect, credit, self._lock, stall_after)
        #: by producer number (``stoker_source``), which stays its own after it leaves the pool
        self.producers: list[KnownProducer] = links.producers
        #: control messages sent and received, and their bytes (the receive thread writes them)
        self.control = links.control
        # What the receiver asks of the links, as their own methods (poll() and owned() are on the per-batch path).
        self.add, self.poll, self.owned, self.live, self.live_links, self.connected, self.failures, self.spec = \
            links.add, links.poll, links.owned, links.live, links.live_links, links.connected, links.failures, \
            links.spec
        self.stale_batches = 0
        self._turn = 0  # reads so far (each producer's ``read_turn``)
        self._mask_at = -1  # where the spec (``configure``) has its mask
        self._pool = PoolSeat(ledger, share, self.producers, links.send, self._restart)  # empty until a pool reports
        self._shard_stalls = ShardStallWatch(stall_after, stall_limit)
        self.stall_error: Optional[str] = None  # set once a fixed-shard producer stayed stuck past stall_limit
        self._stalls_checked = 0.0
        try:
            for address in addresses:
                self.add(address)
        except ValueError:
            self.close()
            raise

    def remove(self, address: str) -> Optional[int]:
        """Disconnect from a producer that left the pool; its number (None if unknown). Batches of it that are
        queued stay valid; what it had not sent is served by others (a shard's own producer comes back, splits
        are handed out again)."""
        i = self.links.remove(address)
        if i is not None:
            self._pool.leave(i)
        return i

    def configure(self, spec: BatchSpec) -> None:
        """The batches this trainer takes (``admit`` cuts their mask) and an elastic pool's producers must make:
        splits are whole batches of ``spec``, and a pool producer describing others gets no work. Once, when the
        spec is known and before batches are received; with the constructor's ``credit``, ``share`` and
        ``stall_after`` it is all a pool's scheduler is made from."""
        self._pool.plan(SchedulerPlan(spec.batch_size, self.credit, self.share, self.stall_after), spec)
        self._mask_at = [a.name for a in spec.arrays].index("mask")  # the column ``admit`` cuts
        for i in self.live():  # a pool producer that reported before this joins now
            status = self.producers[i].status
            if status is not None and serves_pool(status, self.producers[i].session):
                self._pool.join(i, status)

    # ---- state ------------------------------------------------------------------------------

    def record_consumed(self, source: int, epochs: np.ndarray, indices: np.ndarray, mask: np.ndarray) -> None:
        """Rows a step was given (called from the step; any thread)."""
        if source < 0:
            return  # a terminator: no records
        rows = mask.astype(bool)
        epochs, indices = epochs[rows].astype(np.int64), indices[rows].astype(np.int64)
        with self._lock:
            p = self.producers[source]
            if p.stream:
                self.ledger.mark(p.stream, epochs, indices)
            self.links.consumed(source, epochs, indices)
            self._pool.consumed(p.stream, epochs, indices)

    # ---- connections ------------------------------------------------------------------------

    @property
    def active(self) -> bool:  # the ledger was activated: say hello, take batches; no restore any more
        return self.ledger.started

    def activate(self) -> None:
        self.ledger.activate()

    def watch(self) -> bool:
        """Handle monitor events; say hello on new connections once active. True if anything changed."""
        changed = False
        for i in self.links.changed(self.active):  # those that need a look: a link that changed, one waiting for an answer
            p = self.producers[i]
            link = p.link
            assert link is not None
            changed |= link.watch()
            if p.pooled and not link.connected:
                self._pool.leave(i)  # gone (killed, cut off): its splits go to the others; back, it says hello
            handshakes = link.handshakes  # before the hello: a connection made meanwhile gets its own
            hello_due = self.active and handshakes > p.said_hello
            if hello_due and knows_stream(p):
                self._hello(i)
                p.said_hello = handshakes
            elif (hello_due or not self.active and p.status is None) and link.connected \
                    and time.monotonic() - p.described_at >= DESCRIBE_RETRY_S:
                # Asked again until answered (never taken as delivered); a hello waits for it (``hello_state``).
                self.links.send(i, encode_describe())
                p.described_at = time.monotonic()
            self.links.attention.wait(i, self.active and link.handshakes > p.said_hello or not self.active
                                      and p.status is None)
        return changed

    def _hello(self, i: int) -> None:
        self._pool.leave(i)  # a new session: what it was asked to serve before is void
        p = self.producers[i]
        p.session += 1
        with self._lock:
            state, p.hello_stream = hello_state(self.ledger.state, p.stream), p.stream
            held = p.held_records()
            p.reports = []  # the hello's state includes them
        p.owed = 0  # and it gives the whole credit afresh
        p.batch_at = time.monotonic()
        self.links.hello(i, Hello(self.ledger.trainer_id, p.session, self.credit, state, held))

    def _restart(self, i: int) -> None:
        """A new session with producer ``i`` on its current connection (a connection made meanwhile gets its own)."""
        link = self.producers[i].link
        handshakes = link.handshakes if link is not None else 0  # before the hello, as in watch()
        self._hello(i)
        self.producers[i].said_hello = handshakes

    def flush(self, force: bool = False) -> None:
        """Send consumed records and credit that waited long enough (``force``: all of them, e.g. when the
        input stops), and heartbeats where nothing went out for a while."""
        if not self.active:
            return
        now = time.monotonic()
        self.links.send_due(now, force)
        self._pool.give_work_all()
        if now - self._stalls_checked >= _STALL_CHECK_S:
            if now - self._stalls_checked > _PAUSE_S:
                self.queue_full()  # this thread did not run (a paused trainer, a GC): nobody else's silence
            self._stalls_checked = now
            self.stall_error = self.check_stalls(now) or self.stall_error

    # ---- data -------------------------------------------------------------------------------

    def receive(self, i: int) -> Optional[Batch]:
        """A batch from producer ``i`` (not yet held to the spec), or None (a status, handled here).
        ProtocolError for a bad message."""
        p = self.producers[i]
        link = p.link
        assert link is not None
        self._turn += 1
        p.read_turn = self._turn  # links.poll() serves the producer read longest ago first
        message = link.receive()
        if isinstance(message, Batch):
            return message
        p.heard_at = time.monotonic()
        body, nbytes = message
        status = decode_status(body)  # ProtocolError propagates: counted as a rejected message
        self.control.count_status(nbytes)
        p.status = status
        why = hello_again(p, status) if self.active else ""
        if why:  # a stranger, or a producer serving another stream than our hello's (``hello_state``)
            log.warning("producer %s %s: saying hello again", status.producer, why)
            with self._lock:
                p.stream = status.stream or p.stream
            self._restart(i)
            return None
        if status.stream:
            with self._lock:
                p.stream = status.stream
                if status.session == p.session and status.session:
                    self.ledger.note_stream(status.stream, status.completed)
        self._pool.reported(i, status, p.session)
        return None

    def admit(self, i: int, batch: Batch, check: Callable[[Batch], list[np.ndarray]]) -> Optional[list[np.ndarray]]:
        """The one question the receiver asks of a batch from producer ``i``: its arrays to queue (``check``'s, the
        batch held to the spec), the mask cut to the rows this trainer keeps (of an elastic pool, its share's
        records that arrive first: the others are cut off like padding); None if nothing of it is queued: sent
        under an older session (its records are served again), or nothing new of a pool (its credit comes back).
        ProtocolError from ``check`` propagates (then ``rejected``). ``queued`` once the sink took it."""
        header = batch.header
        p = self.producers[i]
        if header.session != p.session or header.session == 0:
            self.stale_batches += 1
            return None
        p.batch_at = time.monotonic()
        stream = header.stream
        if serves_another_stream(p, stream):  # its hello carried another stream's progress (``hello_state``)
            log.warning("producer %s serves %s, not %s as its hello assumed: saying hello again", p.address, stream,
                        p.hello_stream)
            with self._lock:
                p.stream = stream  # what the new hello carries
            self._restart(i)
            return None
        if stream and stream != p.stream:
            with self._lock:
                p.stream = stream
        arrays = check(batch)
        if not StreamKey.names_pool(stream):
            return arrays
        keep = self._pool.arrived(i, stream, batch["epoch"], batch["index"], batch["mask"])
        if not keep.any():
            self.links.give_back(i)
            return None
        if self.owned(i):
            arrays[self._mask_at][...] = keep
        else:  # libzmq's frames are read-only
            batch.arrays["mask"] = arrays[self._mask_at] = keep
        return arrays

    def queued(self, i: int, epochs: np.ndarray, indices: np.ndarray, mask: np.ndarray) -> None:
        """A batch from producer ``i`` entered the queue: its records are held here; one credit back."""
        rows = mask.astype(bool)
        epochs, indices = epochs[rows], indices[rows]
        with self._lock:
            self.producers[i].queued(epochs, indices)
        self.links.give_back(i)

    def rejected(self, i: int) -> None:
        """A batch from producer ``i`` was rejected (undecodable, wrong spec): in a pool its records would never
        arrive, so it starts afresh (a new session: its splits go back and its credit is whole again)."""
        if self.producers[i].pooled:
            self._hello(i)

    # ---- an elastic pool ---------------------------------------------------------------------

    def queue_full(self) -> None:
        """The trainer's queue is full: producers wait for credit, which is not a stall of theirs."""
        now = time.monotonic()
        self._shard_stalls.queue_full(now)
        self._pool.queue_full(now)

    def check_stalls(self, now: Optional[float] = None) -> Optional[str]:
        """Name producers that hold work and send nothing new (see the module doc); the error to fail the input
        with once a fixed-shard producer stayed stuck past ``stall_limit`` (else None)."""
        now = time.monotonic() if now is None else now
        self._pool.check_stalls(now)
        if not self.active:
            return None
        return self._shard_stalls.check(now, self.producers, self.live(), self._open_epochs)

    @property
    def stall_warnings(self) -> int:
        """Warnings that a fixed-shard producer sends nothing (repeated, growing apart)."""
        return self._shard_stalls.warnings

    def _open_epochs(self, stream: str) -> str:
        with self._lock:
            return open_epochs(self.ledger.state, stream)

    def waiting_report(self) -> list[str]:
        """One line per producer for a trainer that waits for data: connected, session, credit owed, last batch
        age, what it holds of an elastic pool's work."""
        now = time.monotonic()
        lines = []
        for i in self.live():
            p = self.producers[i]
            if p.pooled:
                lines.append(p.waiting_line(now) + self._pool.holdings(i))
            else:
                lines.append(p.waiting_line(now) + shard_waiting(p.status, self._open_epochs))
        return lines + self._pool.summary()

    def pool_counters(self) -> tuple[int, int, int, int]:
        """``(splits re-served from stuck producers, backup splits, wasted records, producers taken for stuck)``."""
        return self._pool.counters()

    @property
    def finished(self) -> bool:
        """An elastic pool's epochs are all consumed, or every producer said it finished its epochs."""
        finished = self._pool.finished
        return finished if finished is not None else self.links.finished()

    def close(self) -> None:
        """Say goodbye (an active trainer), then close the links: what the last flush queued (a finished pool's
        "finished", the last steps' records), the goodbyes and the producers' answers get up to 0.5 s."""
        self._pool.close()
        self.links.close(0.5 if self.active else 0.0, goodbye=self.active)


def pool_scheduler(control_plane: ExactControlPlane) -> Optional[SplitScheduler]:
    """An elastic pool's split scheduler once its first producer reported (None: fixed shards, or not yet), for
    what benchmarks and tests read of it (progress, the stall bound)."""
    return control_plane._pool.scheduler

