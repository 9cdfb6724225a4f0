"""The daemon's sending thread: ready slots out to trainers, sent slots back to their workers.

    worker --[ready, slot, header]--> ROUTER (ipc) --> SlotForwarder --[header, slot memory]--> PUSH (tcp)
    worker <--------[grant, slot]---- ROUTER <------- (when libzmq is done with the slot's memory)

The slot's large arrays go out with ``copy=False`` and a tracker per frame (its small
ones are copied as they are sent): the slot is granted back to its worker only once
libzmq has released every tracked frame, so memory a trainer may still be receiving
is never overwritten. A slot is sent only while
the PUSH socket has room (its SNDHWM), so a slow or absent trainer leaves slots
ready, workers run out of granted slots and wait: backpressure, bounded memory.

All sockets here are used by the forwarding thread only. ``register_worker`` (any
thread) announces the routing id of a freshly started worker process; messages
from any other id (a worker that died) are ignored. A slot is granted at most once
to a given process: each slot remembers whom it was granted to, and the control
socket is ROUTER_MANDATORY, so a grant that cannot be delivered (the process is not
connected yet) is not counted as given; the process's hello then grants it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Mapping

import zmq

from stoker.producer.serve.batch_slots import (GRANT, HELLO, READY, Slot, SlotLayout, SlotState, WorkerSlots, parse_slot,
                                               slot_frame, worker_slots)

log = logging.getLogger("stoker.producer")

_IDLE_POLL_MS = 100
IN_FLIGHT_POLL_MS = 2  # how soon a sent slot is noticed free; a wake-up costs ~20 us


def slot_frames(out: zmq.Socket, arrays: Mapping[str, Any], names: list[str]) -> tuple[list[Any], zmq.MessageTracker]:
    """A slot's ``arrays`` as the frames to send on ``out``, and the tracker that says when libzmq is done with the
    slot. An array of at least ``out.copy_threshold`` bytes goes from the slot itself, tracked; a smaller one
    (labels, index, a caption) as it is, which pyzmq copies as it sends, so it holds no tracker: each tracked frame
    costs pyzmq's garbage thread a wake-up when freed."""
    threshold = out.copy_threshold
    frames = [zmq.Frame(arrays[name], copy=False, track=True) if arrays[name].nbytes >= threshold else arrays[name]
              for name in names]
    return frames, zmq.MessageTracker(*[f for f in frames if isinstance(f, zmq.Frame)])


class SlotForwarder:
    """Moves batches from workers' shared slots to the trainer-facing socket; see the module doc."""

    def __init__(self, control: zmq.Socket, out: zmq.Socket, layout: SlotLayout, buffers: list[Any]) -> None:
        self.control, self.out, self.layout = control, out, layout
        self.names = list(layout.names)
        self.workers: list[WorkerSlots] = worker_slots(layout, buffers)
        # Each worker's record by the routing id of its current process; both written by register_worker only.
        self._by_routing_id: dict[bytes, WorkerSlots] = {}
        self._ready: deque[tuple[Slot, bytes]] = deque()
        self._in_flight: list[tuple[Slot, zmq.MessageTracker]] = []
        self.ignored_messages = 0

    @property
    def finished(self) -> bool:
        """Whether the run is over and sent: a plain run never ends by itself (``ExactForwarder``'s may)."""
        return False

    def register_worker(self, worker: int, routing_id: bytes) -> None:
        """The worker process started with ``routing_id`` now owns worker slot set ``worker``."""
        record = self.workers[worker]
        old, record.routing_id = record.routing_id, routing_id
        self._by_routing_id[routing_id] = record
        self._by_routing_id.pop(old, None)  # a dead process's messages are ignored from now on

    def run(self, stop: threading.Event) -> None:
        """Forward until ``stop`` is set. A bad control message is logged and counted; anything else is logged."""
        try:
            self._forward(stop)
        except Exception:  # a bug: the daemon sees this thread gone and stops loudly rather than hang
            log.exception("forwarding thread failed")

    def _forward(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        while not stop.is_set():
            poller.register(self.out, self.before_poll())
            self.after_poll(dict(poller.poll(self.poll_ms)))

    # One turn of the loop above in two halves, so one thread can drive many forwarders over one poll
    # (producer/fleet/: a thousand endpoints in a few processes).

    def before_poll(self) -> int:
        """Grant back the slots libzmq is done with; the events to poll ``out`` for (POLLOUT while a slot is ready)."""
        self._release_sent()
        return zmq.POLLOUT if self._ready else 0

    @property
    def poll_ms(self) -> int:
        """How long a poll may wait: short while slots are in flight (their trackers are not pollable)."""
        return IN_FLIGHT_POLL_MS if self._in_flight else _IDLE_POLL_MS

    def after_poll(self, events: dict) -> None:
        """Take the workers' messages and send ready slots, given a poll's ``events`` (``{socket: flags}``)."""
        self._from_workers(events)
        while self._ready and self.out.poll(0, zmq.POLLOUT):
            if not self._send(*self._ready[0]):
                break  # the trainer left between the poll and the send: the slot waits, ready
            self._ready.popleft()

    def _from_workers(self, events: dict) -> None:
        """Handle every message the workers sent, if the poll (``events``) found any."""
        if events.get(self.control, 0) & zmq.POLLIN:
            while self.control.poll(0):
                self._handle(self.control.recv_multipart())

    def _handle(self, message: list[bytes]) -> None:
        routing_id, body = message[0], message[1:]
        worker = self._by_routing_id.get(routing_id)
        if worker is None:
            self.ignored_messages += 1  # a worker that died and was replaced: its slots were re-granted
            return
        try:
            if body == [HELLO]:
                for slot in worker.slots:
                    if slot.state is SlotState.AT_WORKER and slot.granted_to != routing_id:
                        self._grant(slot)
            elif len(body) == 3 and body[0] == READY:
                slot = worker.slots[parse_slot(body[1], self.layout.slots)]
                if slot.state is not SlotState.AT_WORKER or slot.granted_to != routing_id:
                    raise ValueError(f"slot {slot.number} is {slot.state.value}, not granted to this worker")
                slot.state = SlotState.READY
                self._ready.append((slot, body[2]))
            else:
                raise ValueError(f"unknown control message of {len(body)} frames")
        except ValueError as exc:
            self.ignored_messages += 1
            log.error("worker %d sent a bad control message, ignored: %s", worker.number, exc)

    def _send(self, slot: Slot, header: bytes) -> bool:
        """Send a ready slot; False if it cannot go now. Never blocks: a PUSH whose last trainer left between
        the poll and the send would block for ever, and the daemon's shutdown then closed the socket under
        this thread (a libzmq assertion, ``pfd.revents & POLLIN``, seen once in CI)."""
        frames, tracker = slot_frames(self.out, slot.views, self.names)
        try:
            self.out.send_multipart([header, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False  # nothing of it went (a multipart message is taken whole or not at all)
        finally:
            del frames  # our references would keep the trackers pending
        slot.state = SlotState.IN_FLIGHT
        self._in_flight.append((slot, tracker))
        return True

    def _release_sent(self) -> None:
        still = []
        for slot, tracker in self._in_flight:
            if not tracker.done:
                still.append((slot, tracker))
                continue
            slot.state = SlotState.AT_WORKER
            self._grant(slot)
        self._in_flight = still

    def _grant(self, slot: Slot) -> None:
        routing_id = slot.worker.routing_id
        try:
            self.control.send_multipart([routing_id, GRANT, slot_frame(slot.number)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # EHOSTUNREACH: that process is dead or not connected yet; its hello grants it
            return
        slot.granted_to = routing_id
