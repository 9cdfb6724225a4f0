"""Batch buffers in shared memory, written by a worker and sent from there by the daemon.

A worker decodes straight into a *slot* (one batch worth of arrays) and hands the
daemon only the slot number and the batch header; the daemon sends the slot's
memory on its TCP socket with ``copy=False``. So a batch's bytes are copied once,
by the kernel into the trainer's connection, instead of three times (worker ->
ipc -> daemon -> TCP) as with a proxy.

Ownership of a slot moves worker -> daemon (``ready``) -> libzmq (in flight until
its tracker is done) -> worker (``grant``); the daemon keeps that state, one
``Slot`` record per slot in one ``WorkerSlots`` record per worker, so a slot is
never written while ZMQ may still read it. Memory is bounded by
``workers x slots x batch bytes``, allocated once at start.

The control messages between worker and daemon travel on a local ipc socket as a
few plain frames: ``[b"hello"]``, ``[b"ready", slot, header]`` from the
worker, ``[b"grant", slot]`` from the daemon (``[b"grant", slot, work]`` in exact
mode: the records to make, chosen by the daemon), each prefixed by ZMQ with the
worker's routing id. A restarted worker gets a fresh routing id, so messages of
a dead worker are recognised as stale and ignored.
"""

from __future__ import annotations

import enum
import multiprocessing as mp
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import msgpack
import numpy as np

if TYPE_CHECKING:  # the policies import the forwarders, which import this module
    from stoker.producer.serve.policies.serving_policy import Chunk


ArrayLayout = tuple[tuple[str, str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class SlotLayout:
    """Where each array of each slot lives inside one worker's shared buffer.

    ``arrays``: the batch's arrays in wire order, ``(name, dtype, per-sample shape)``
    (``Pipeline.batch_arrays()``).
    """

    arrays: ArrayLayout
    batch_size: int
    slots: int

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.arrays)

    @property
    def slot_bytes(self) -> int:
        total = 0
        for _, dtype, shape in self.arrays:
            total = _align(total) + self.batch_size * int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return _align(total)

    def views(self, buffer: Any) -> list[dict[str, np.ndarray]]:
        """Writable numpy views, one dict of arrays per slot, over ``buffer`` (no copy)."""
        flat = np.frombuffer(buffer, np.uint8)
        if flat.nbytes < self.slots * self.slot_bytes:
            raise ValueError(f"shared buffer holds {flat.nbytes} bytes, layout needs {self.slots * self.slot_bytes}")
        out = []
        for slot in range(self.slots):
            offset, arrays = slot * self.slot_bytes, {}
            for name, dtype, shape in self.arrays:
                offset = _align(offset)
                count = self.batch_size * int(np.prod(shape, dtype=np.int64))
                arrays[name] = flat[offset : offset + count * np.dtype(dtype).itemsize].view(dtype).reshape(
                    (self.batch_size, *shape))
                offset += arrays[name].nbytes
            out.append(arrays)
        return out


def sample_rows(arrays: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Per sample of one slot: a dict of writable views of its row in every array (0-d for scalars)."""
    batch = len(next(iter(arrays.values())))
    return [{name: array[i, ...] for name, array in arrays.items()} for i in range(batch)]


def _align(offset: int, to: int = 64) -> int:
    return (offset + to - 1) // to * to


def allocate(layout: SlotLayout, workers: int, ctx: Any = None) -> list[Any]:
    """One shared buffer per worker (``RawArray``: its file is unlinked at once, nothing can leak)."""
    ctx = ctx or mp.get_context("spawn")
    return [ctx.RawArray("B", layout.slots * layout.slot_bytes) for _ in range(workers)]


class SlotState(enum.Enum):
    AT_WORKER = "at worker"  # granted (or about to be): the worker may write it
    READY = "ready"  # filled, waiting for the trainer-facing socket
    IN_FLIGHT = "in flight"  # handed to libzmq; reusable once its tracker is done


@dataclass(eq=False)
class Slot:
    """One batch slot as the daemon's forwarding thread sees it (that thread alone reads and writes it).

    ``granted_to`` is the routing id of the process it was last granted to: a slot is granted at most once to
    one process, so a worker killed mid-batch never has a slot granted twice. ``work``, in exact mode, is the
    records it was granted to make (a ``Chunk``), until they are sent or handed back.
    """

    worker: WorkerSlots = field(repr=False)
    number: int
    views: dict[str, np.ndarray] = field(repr=False)  # its arrays in the worker's shared buffer
    state: SlotState = SlotState.AT_WORKER
    granted_to: bytes = b""
    work: Optional[Chunk] = None


@dataclass(eq=False)
class WorkerSlots:
    """One worker as the daemon knows it: the routing id of its current process (fresh for every start; b"" before
    the first) and its slots."""

    number: int
    slots: list[Slot] = field(default_factory=list)
    routing_id: bytes = b""


def worker_slots(layout: SlotLayout, buffers: list[Any]) -> list[WorkerSlots]:
    """The daemon's record of each worker and its slots, over the shared ``buffers`` (``allocate``), all at the
    worker."""
    workers = [WorkerSlots(w) for w in range(len(buffers))]
    for worker, buffer in zip(workers, buffers):
        worker.slots = [Slot(worker, number, views) for number, views in enumerate(layout.views(buffer))]
    return workers


HELLO, READY, GRANT = b"hello", b"ready", b"grant"


def encode_work(epochs: list[int], indices: list[int]) -> bytes:
    """The records a worker makes into its next batch (exact mode), sent with the slot grant."""
    return msgpack.packb([list(map(int, epochs)), list(map(int, indices))])


def decode_work(frame: bytes, batch_size: int) -> list[tuple[int, int]]:
    """``[(epoch, record index)]`` from a grant's work frame; ValueError if it is not one."""
    body = msgpack.unpackb(frame)
    if not (isinstance(body, list) and len(body) == 2 and len(body[0]) == len(body[1]) <= batch_size):
        raise ValueError(f"work frame must be [epochs, indices] of at most {batch_size} rows")
    return [(int(e), int(i)) for e, i in zip(*body)]


def slot_frame(slot: int) -> bytes:
    return slot.to_bytes(2, "little")


def parse_slot(frame: bytes, slots: int) -> int:
    """The slot number in a control frame; ValueError if it is not one."""
    if len(frame) != 2:
        raise ValueError(f"slot frame has {len(frame)} bytes, expected 2")
    slot = int.from_bytes(frame, "little")
    if slot >= slots:
        raise ValueError(f"slot {slot} out of range (0..{slots - 1})")
    return slot
