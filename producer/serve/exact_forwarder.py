"""The daemon's forwarding thread in exact mode: chosen records to workers, batches to trainers with credit.

    ExactPolicy --which records--> grant [slot, work] --> worker --ready--> ExactForwarder
    trainers (DEALER) <--batch [header + stream, session]-- ROUTER <--hello / credit / work / goodbye-- trainers

Like ``SlotForwarder`` (shared-memory slots sent with ``copy=False``, a slot reused
only once libzmq is done with it), but the trainer-facing socket is a ROUTER:
each batch goes to one trainer that has credit, so the serving policy (policies/:
``FixedShardPolicy`` for a fixed shard, ``PoolPolicy`` for an elastic pool) knows who
holds which records. A slot is granted to a worker only with work (records the
policy chose); with nothing to serve it waits. Trainers' ``hello``, ``credit``, ``work`` and ``goodbye``
messages arrive on the same socket; a malformed one, or work the policy refuses,
is counted and logged (rate-limited), never fatal. A trainer that says goodbye is forgotten at once
(INFO: it left); one that vanishes without it is a WARNING when found unreachable or silent. The policy's status
goes to every trainer when the policy says it changed (an epoch completed, the run finished), and to each trainer
that heard no status for the period its hello asked for (``status_s``: every second from an older trainer; a trainer
reading many producers asks for fewer, docs/protocol.md "Liveness"); every status names this producer's trainer
timeout, by which the trainer spaces its heartbeats. All sockets are used by this thread only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import numpy as np
import zmq

from stoker.protocol import ProtocolError
from stoker.protocol.batch_codec import with_session
from stoker.protocol.exact_messages import (STATUS_S, Credit, Describe, Goodbye, Hello, Status, Work,
                                            decode_trainer_message, encode_status)

from stoker.producer.serve.batch_slots import GRANT, Slot, SlotLayout, SlotState, encode_work, slot_frame
from stoker.producer.serve.forwarder import IN_FLIGHT_POLL_MS, SlotForwarder, slot_frames
from stoker.producer.serve.policies.serving_policy import ExactPolicy

log = logging.getLogger("stoker.producer")

_WARN_EVERY_S = 60.0
STATUS_EVERY_S = STATUS_S  # also a heartbeat: a trainer waiting on others' steps knows this producer is alive
MAX_STATUS_CHECK_S = 1.0  # a trainer that joined meanwhile gets its first period's status no later than this
IDLE_POLL_MS = 50  # nothing in flight: statuses and expiry need no finer clock than this
_EXPIRE_EVERY_S = 0.1


class ExactForwarder(SlotForwarder):
    """See the module doc. ``out`` is a bound ROUTER; ``policy`` decides what is served."""

    def __init__(self, control: zmq.Socket, out: zmq.Socket, layout: SlotLayout, buffers: list[Any],
                 policy: ExactPolicy) -> None:
        super().__init__(control, out, layout, buffers)
        self.policy = policy
        self._stream = str(policy.key)
        self.idle: deque[Slot] = deque()  # slots at their worker with nothing to make yet
        self.bad_messages = 0
        self.stale_rows = 0  # rows masked at sending: consumed or held since chosen (FixedShardPolicy.take_stale)
        self._last_bad_log = -_WARN_EVERY_S
        self._status_every: dict[bytes, float] = {}  # trainer -> the period its hello asked for (``status_s``)
        self._status_at: dict[bytes, float] = {}  # trainer -> when it was last sent a status
        self._next_status = 0.0  # no trainer's period ends before this
        self._unknown_told: dict[bytes, float] = {}
        self._expired_at = 0.0

    # ---- the loop ---------------------------------------------------------------------------

    def _forward(self, stop: Any) -> None:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        while not stop.is_set():
            poller.register(self.out, self.before_poll())
            self.after_poll(dict(poller.poll(self.poll_ms)))

    # The turn in halves (SlotForwarder's): a fleet's one thread drives many forwarders over one poll, and runs
    # after_poll for every endpoint at least every IDLE_POLL_MS, as this loop does (producer/fleet/).

    def before_poll(self) -> int:
        self._release_sent()
        return zmq.POLLIN  # credit, work and hellos from trainers

    @property
    def poll_ms(self) -> int:
        # Sent slots are checked every 2 ms until libzmq lets go of them; batches waiting for credit need no
        # such wake-ups: the credit that frees them arrives on ``out`` and ends the wait.
        return IN_FLIGHT_POLL_MS if self._in_flight else IDLE_POLL_MS

    def after_poll(self, events: dict) -> None:
        self._from_workers(events)
        if events.get(self.out, 0) & zmq.POLLIN:
            while self.out.poll(0):
                self._from_trainer(self.out.recv_multipart())
        now = time.monotonic()
        if now - self._expired_at >= _EXPIRE_EVERY_S:
            self._expired_at = now
            for trainer in self.policy.trainers.expire(now):
                log.warning("trainer %s sent nothing for %.0f s: taken for dead; the records it held are served "
                            "again", trainer, self.policy.trainers.timeout)
        self._grant_idle()
        self._send_ready()
        self._broadcast_status()

    # ---- workers ----------------------------------------------------------------------------

    def _grant(self, slot: Slot) -> None:
        """Grant ``slot`` with the next records to make; with nothing to serve it waits in ``idle``."""
        old, slot.work = slot.work, None
        if old is not None and slot.state is SlotState.AT_WORKER:
            self.policy.on_unsent(old)  # granted to a worker that died before making it
        chunk = self.policy.next_chunk(self.layout.batch_size)
        if chunk is None:
            if slot not in self.idle:
                self.idle.append(slot)
            return
        routing_id = slot.worker.routing_id
        try:
            self.control.send_multipart([routing_id, GRANT, slot_frame(slot.number),
                                         encode_work(chunk.epochs, chunk.indices)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # that worker is gone or not connected yet: its hello grants again
            self.policy.on_unsent(chunk)
            return
        slot.work = chunk
        slot.granted_to = routing_id

    def _grant_idle(self) -> None:
        for _ in range(len(self.idle)):
            slot = self.idle.popleft()
            if slot.state is SlotState.AT_WORKER:
                self._grant(slot)
            if self.idle and self.idle[-1] is slot:
                break  # nothing to serve now

    # ---- trainers ---------------------------------------------------------------------------

    def _from_trainer(self, message: list[bytes]) -> None:
        routing_id = message[0]
        try:
            if len(message) != 2:
                raise ProtocolError(f"control message of {len(message) - 1} frames, expected 1")
            body = decode_trainer_message(message[1])
        except ProtocolError as exc:
            self._count_bad(f"rejected a trainer's control message: {exc}")
            return
        if isinstance(body, Work):
            self._on_work(routing_id, body)
        elif isinstance(body, Hello):
            self.policy.on_hello(routing_id, body)
            self._status_every[routing_id] = body.status_s
            status = self._status_to(routing_id)
            log.info("trainer %s (session %d) joined with credit %d; serving epoch %d", body.trainer, body.session,
                     body.credit, status.completed)
        elif isinstance(body, Credit):
            if not self.policy.on_credit(routing_id, body):
                self._unknown(routing_id)
        elif isinstance(body, Describe):
            self._status_to(routing_id)
        elif isinstance(body, Goodbye):
            self._on_goodbye(routing_id, body)

    def _on_goodbye(self, routing_id: bytes, goodbye: Goodbye) -> None:
        """Forget the trainer, and answer with a status (of session 0: it is not known here now); the trainer closes
        its connection once that came (protocol.md), so this goodbye is read before anything resets it."""
        trainers = self.policy.trainers
        trainer = trainers.leave(routing_id, goodbye.session)
        self._status_to(routing_id)
        if trainer is None:  # taken for dead or back under a new session meanwhile: nothing of it is left
            log.debug("a goodbye from a trainer of an old session or unknown here (session %d)", goodbye.session)
            return
        log.info("trainer %s (session %d) said goodbye: it left, and the records it held are served again "
                 "(goodbyes=%d, trainers_lost=%d)", trainer, goodbye.session, trainers.goodbyes, trainers.lost)

    def _on_work(self, routing_id: bytes, work: Work) -> None:
        try:
            known = self.policy.on_work(routing_id, work)  # a fixed shard refuses any
        except ProtocolError as exc:
            self._count_bad(f"refused a trainer's work: {exc}")
            return
        if not known:
            self._unknown(routing_id)

    def _count_bad(self, what: str) -> None:
        self.bad_messages += 1
        now = time.monotonic()
        if now - self._last_bad_log >= _WARN_EVERY_S:
            self._last_bad_log = now
            log.warning("%s (%d bad messages in all)", what, self.bad_messages)

    def _unknown(self, routing_id: bytes) -> None:
        """Credit or work from a trainer this producer dropped (silent past --trainer-timeout) or of an old
        session: a status of session 0 tells it to say hello again, or it would wait for batches for ever."""
        now = time.monotonic()
        if now - self._unknown_told.get(routing_id, -STATUS_EVERY_S) >= STATUS_EVERY_S:
            self._unknown_told[routing_id] = now
            if len(self._unknown_told) > 4096:
                self._unknown_told.clear()
            self._status_to(routing_id, stranger=True)

    def _status_to(self, routing_id: bytes, stranger: bool = False, spec: bool = True) -> Status:
        """A status to one trainer; ``spec=False``: without the batch spec (the periodic and changed ones: a trainer
        learns the spec from the answer to its describe or hello, which carries it)."""
        status = self.policy.status(routing_id, stranger)
        status.trainer_timeout = self.policy.trainers.timeout
        if not spec:
            status.spec = []
        self._status_at[routing_id] = time.monotonic()
        try:
            self.out.send_multipart([routing_id, encode_status(status)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # gone: it will say hello again if it comes back
        return status

    def _broadcast_status(self) -> None:
        """A status to every trainer when the policy changed, else to those whose period (``status_s``) ended."""
        now = time.monotonic()
        changed = self.policy.take_status_change()
        if not changed and now < self._next_status:
            return
        next_status = now + MAX_STATUS_CHECK_S
        for routing_id in self.policy.trainers:
            every = self._status_every.get(routing_id, STATUS_EVERY_S)
            if changed or now - self._status_at.get(routing_id, 0.0) >= every:
                self._status_to(routing_id, spec=False)
            next_status = min(next_status, self._status_at.get(routing_id, now) + every)
        self._next_status = next_status
        if len(self._status_at) > 2 * len(self.policy.trainers) + 64:  # trainers gone: forget them
            live = set(self.policy.trainers)
            self._status_at = {t: at for t, at in self._status_at.items() if t in live}
            self._status_every = {t: s for t, s in self._status_every.items() if t in live}

    def _send_ready(self) -> None:
        """Send made batches in order, each to its trainer (any with credit, or the one it was made for)."""
        position = 0
        while position < len(self._ready):
            slot, header = self._ready[position]
            chunk = slot.work
            routing_id = self.policy.route(chunk)
            if routing_id is None:
                position += 1  # its trainer has no credit now; later batches may be another trainer's
                continue
            if not self._send_to(routing_id, slot, header):
                if chunk is not None and chunk.trainer is not None:
                    position += 1  # that trainer's pipe is full; the others' batches go on
                    continue
                return
            del self._ready[position]

    def _send_to(self, routing_id: bytes, slot: Slot, header: bytes) -> bool:
        """Send a made batch to ``routing_id`` (False: its pipe is full or it left; the batch stays ready), or
        give the slot back unsent when nothing of it is wanted any more."""
        arrays, chunk = slot.views, slot.work
        mask, indices, epochs = arrays["mask"], arrays["index"], arrays["epoch"]
        valid = mask.astype(bool)
        failed = ~valid & (indices >= 0)
        wanted = self.policy.wanted(chunk, epochs, indices, valid)
        if wanted is None:  # an elastic pool's batch whose trainer left or restarted: it hands out its splits afresh
            self._take_back(slot)
            return True
        stale = valid & ~wanted
        if stale.any():  # consumed or held elsewhere since they were chosen: never served twice
            # Padding to the trainer (masked rows are cut off) and to a retried send (index -1: not a failure).
            mask[stale], indices[stale] = 0, -1
            valid &= ~stale
            self.stale_rows += int(stale.sum())
            log.info("left %d row(s) out of a batch: their records were consumed or are held by a trainer that "
                     "came back since they were chosen (%d so far)", int(stale.sum()), self.stale_rows)
        if not wanted.any():  # nothing of it left to serve: the slot goes back unsent
            self._settle_failed(epochs, indices, failed)
            self._take_back(slot)
            return True
        header = with_session(header, stream=self._stream, session=self.policy.trainers.session_of(routing_id))
        frames, tracker = slot_frames(self.out, arrays, self.names)
        try:
            self.out.send_multipart([routing_id, header, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False  # that trainer's pipe is full: try again later
        except zmq.ZMQError:  # EHOSTUNREACH: it disconnected
            log.warning("trainer %s is unreachable: the records it held are served again",
                        self.policy.trainers.drop(routing_id))
            return False
        finally:
            del frames
        self.policy.on_sent(routing_id, epochs[valid].tolist(), indices[valid].tolist(), chunk)
        self._settle_failed(epochs, indices, failed)
        slot.work = None
        slot.state = SlotState.IN_FLIGHT
        self._in_flight.append((slot, tracker))
        return True

    def _settle_failed(self, epochs: np.ndarray, indices: np.ndarray, failed: np.ndarray) -> None:
        if failed.any():
            self.policy.on_skipped(epochs[failed].tolist(), indices[failed].tolist())

    def _take_back(self, slot: Slot) -> None:
        """A made batch is not sent: its slot goes back to its worker, with new work if there is any."""
        slot.work = None
        slot.state = SlotState.AT_WORKER
        self._grant(slot)

    @property
    def finished(self) -> bool:
        return self.policy.finished and not self._ready and not self._in_flight
