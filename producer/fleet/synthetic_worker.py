"""A worker without a process: the in-process stand-in for worker.py that a fleet endpoint's forwarder talks to.

It speaks the real worker's side of the control protocol (``batch_slots``: ``hello``, then a ``ready`` with the
batch header for each ``grant``ed slot) on a DEALER over ``inproc://``, so the forwarder, its slots and its
trackers run unchanged. What it skips is the work: no dataset, no pipeline. A batch's records are the next of the
endpoint's stream (``StreamKey.order``, epoch after epoch, as one worker's ``worker_stream`` takes them), written
as whole columns; its pixels say their record (every byte ``index % 251``) and its label is ``index % classes``, so
a trainer can check any row it receives against its index. The header is the real codec's (``encode_batch``),
with the stream and a sequence number per batch. In exact mode each grant carries the records to make (the
forwarder's choice, ``decode_work``), and the batch holds those.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zmq

from stoker.protocol import encode_batch
from stoker.protocol.batch_spec import bookkeeping_arrays
from stoker.protocol.input_state import StreamKey

from stoker.producer.serve.batch_slots import (GRANT, HELLO, READY, ArrayLayout, SlotLayout, decode_work, parse_slot,
                                               slot_frame)
from stoker.producer.serve.sharding import EpochOrders

PIXEL_MODULUS = 251  # a prime, so neighbouring records' pixels differ


def synthetic_arrays(image_size: int, exact: bool = False) -> ArrayLayout:
    """The arrays of a fleet's batches, in wire order: ``images`` (uint8, S x S x 3), ``labels`` (int32), then
    the bookkeeping columns every producer appends (``index``, ``epoch``; exact mode's ``mask``)."""
    return (("images", "uint8", (image_size, image_size, 3)), ("labels", "int32", ()),
            *((name, dtype, ()) for name, dtype in bookkeeping_arrays(exact)))


def expected_pixels(indices: np.ndarray) -> np.ndarray:
    """The value every pixel of each row holds, by its record index (what a trainer checks a row against)."""
    return (np.asarray(indices) % PIXEL_MODULUS).astype(np.uint8)


class RecordCursor:
    """The next records of one stream, epoch after epoch, taken a batch at a time as whole arrays."""

    def __init__(self, key: StreamKey) -> None:
        self.orders = EpochOrders(key)
        self.epoch, self.position = 0, 0

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(epochs int32 [n], indices int64 [n])``: the next ``n`` records (a batch may span an epoch's end)."""
        epochs, indices = [], []
        while n > 0:
            order = self.orders(self.epoch)
            part = order[self.position:self.position + n]
            epochs.append(np.full(len(part), self.epoch, np.int32))
            indices.append(part)
            n -= len(part)
            self.position += len(part)
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return np.concatenate(epochs), np.concatenate(indices).astype(np.int64, copy=False)


class SyntheticWorker:
    """Worker 0 of one fleet endpoint: makes a synthetic batch into each slot its forwarder grants.

    ``views``: the slots' arrays (``SlotLayout.views`` of the endpoint's buffer); ``routing_id``: the id its
    forwarder knows it by (``register_worker``). Used by the fleet's one thread only; ``close`` closes its socket.
    """

    def __init__(self, ctx: zmq.Context, control: str, routing_id: bytes, layout: SlotLayout, buffer: Any,
                 key: StreamKey, producer_id: str, classes: int) -> None:
        self.views = layout.views(buffer)
        self.slots, self.batch_size = layout.slots, layout.batch_size
        self.cursor = RecordCursor(key)
        self.stream, self.producer_id, self.classes = str(key), producer_id, classes
        self.batches = 0
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(control)
        self.sock.send(HELLO)

    def on_grants(self) -> None:
        """Make a batch for every grant waiting on the socket (never blocks). A malformed grant is a bug on our
        own side of an inproc socket: ValueError."""
        while self.sock.poll(0):
            message = self.sock.recv_multipart()
            if len(message) not in (2, 3) or message[0] != GRANT:
                raise ValueError(f"a fleet worker got {len(message)} frames, not a grant [grant, slot(, work)]")
            slot = parse_slot(message[1], self.slots)
            if len(message) == 3:  # exact mode: the forwarder chose the records
                work = np.array(decode_work(message[2], self.batch_size), np.int64).reshape(-1, 2)
                self._make(slot, work[:, 0].astype(np.int32), work[:, 1])
            else:
                self._make(slot, *self.cursor.take(self.batch_size))

    def _make(self, slot: int, epochs: np.ndarray, indices: np.ndarray) -> None:
        """Rows ``0 .. len(indices) - 1`` made of these records; in exact mode the rest are padding, as
        ``BatchMaker`` writes it (zeros, index and epoch -1, ``mask`` False)."""
        arrays, n = self.views[slot], len(indices)
        for array in arrays.values():
            array[n:] = 0
        arrays["index"][:n], arrays["epoch"][:n] = indices, epochs
        arrays["index"][n:], arrays["epoch"][n:] = -1, -1
        if "mask" in arrays:
            arrays["mask"][:n] = True
        arrays["labels"][:n] = indices % self.classes
        arrays["images"][:n] = expected_pixels(indices).reshape(-1, *([1] * (arrays["images"].ndim - 1)))
        header = encode_batch(arrays, producer=self.producer_id, seq=self.batches, stream=self.stream,
                              classes=self.classes, source="synthetic fleet")[0]
        self.sock.send_multipart([READY, slot_frame(slot), header])
        self.batches += 1

    def close(self) -> None:
        self.sock.close(linger=0)
