#!/usr/bin/env python3
"""tensorpack 0.11 on Stoker's reference job; runs in tensorpack's own venv (numpy<2).

MultiProcessRunnerZMQ runs N copies of (LMDB read -> decode + random-resized-crop +
flip, the same code as Stoker's workers -> BatchData 64) and send_dataflow_zmq
pushes the batches to RemoteDataZMQ in another process, as tensorpack users do.
Prints one JSON line: {"images_per_s": ...}.

Usage: TP_VENV/bin/python peer_tensorpack.py LMDB --procs 2 --batches 60
(needs `TP_VENV/bin/pip install --no-deps .` so the augmentation code is shared).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import tempfile
import time

import lmdb
import msgpack
import numpy as np
from tensorpack.dataflow import BatchData, DataFlow, MultiProcessRunnerZMQ, RemoteDataZMQ, send_dataflow_zmq

from stoker.producer.images.augment import decode_train_crop, resize_flip_into


class StokerLmdbImages(DataFlow):
    """Endless random records of a Stoker LMDB, decoded and augmented to [size, size, 3] RGB."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size

    def reset_state(self) -> None:
        self.env = lmdb.open(self.path, readonly=True, lock=False)
        with self.env.begin() as txn:
            self.count = msgpack.unpackb(txn.get(b"__stoker_meta__"))["count"]
        self.rng = np.random.default_rng()

    def __iter__(self):
        while True:
            index = int(self.rng.integers(0, self.count))
            with self.env.begin() as txn:
                record = msgpack.unpackb(txn.get(b"%08d" % index))
            out = np.empty((self.size, self.size, 3), np.uint8)
            resize_flip_into(decode_train_crop(record["image"], self.rng), self.size, self.rng, out)
            yield [out, np.int32(record["label"])]


def send(path: str, addr: str, procs: int, batch: int, size: int) -> None:
    # Own process group: tensorpack's forked workers outlive their parent (no python-prctl),
    # so main() kills the whole group rather than leave them blocked in send() forever.
    os.setsid()
    df = BatchData(StokerLmdbImages(path, size), batch)
    df = MultiProcessRunnerZMQ(df, num_proc=procs, hwm=4)
    send_dataflow_zmq(df, addr, hwm=4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lmdb")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    signal.alarm(300)  # never hang: the whole measurement takes well under a minute
    addr = f"ipc://{tempfile.mkdtemp(prefix='stoker-peer-tensorpack-')}/sock"
    # Not a daemon process: MultiProcessRunnerZMQ starts children, which daemons may not have.
    sender = mp.Process(target=send, args=(args.lmdb, addr, args.procs, args.batch_size, args.image_size))
    sender.start()
    try:
        remote = RemoteDataZMQ(addr, hwm=4)
        remote.reset_state()
        it = iter(remote)
        for _ in range(args.warmup):
            next(it)
        t0 = time.perf_counter()
        for _ in range(args.batches):
            images, labels = next(it)
            assert images.shape == (args.batch_size, args.image_size, args.image_size, 3)
        rate = args.batches * args.batch_size / (time.perf_counter() - t0)
        print(json.dumps({"images_per_s": rate}), flush=True)
    finally:
        try:
            os.killpg(sender.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sender.join(5)


if __name__ == "__main__":
    main()
