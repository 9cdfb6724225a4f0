#!/usr/bin/env python3
"""What a receive path of our own would buy the trainer: plain TCP straight into aligned memory.

A probe, not a transport: it answers "measure before you build" for trainer ingest
(docs/performance.md, section 9). libzmq hands the trainer frames it allocated itself, only
8-byte aligned, so TensorFlow can only take them after one copy. A socket read with
``recv_into`` can land the bytes in a pooled 64-byte-aligned buffer TensorFlow then takes
through DLPack: no copy at all beyond the kernel's. This script measures, in one run and
interleaved rounds, with one sender on loopback serving the same pre-made 64 x 224 batch:

- raw bare: ``recv_into`` one reused buffer, nothing else (the ceiling of this path);
- raw into TensorFlow: ``recv_into`` pooled aligned buffers, DLPack import, the raw enqueue op
  into a FIFOQueue, and a ``tf.function`` step that dequeues, stages and unstages through
  Stoker's StagingArea exactly as ``ZMQInput.get()`` does;
- for reference, against a real ``stoker produce --repeat-batches``: the bare pyzmq loop and
  ``ZMQInput`` (``benchmarks/trainer_ingest.py``'s receivers).

The sender is this script run with ``--serve``: a bare framing of 4 arrays back to back, no
header, no validation, no security, one trainer; everything a product needs on top is left out,
so read its figures as an upper bound. Prints a table, writes JSON.
Run:  python benchmarks/raw_receive_probe.py [--rounds 5] [--batches 300]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import (add_out_argument, benchmark_parser, launch_producer, machine_info, own_cpu_seconds,
                     producer_flags, write_results)

BATCH, SIZE = 64, 224
# The batch Stoker's imagenet pipeline sends: images, labels, index, epoch.
LAYOUT = [("images", "uint8", (BATCH, SIZE, SIZE, 3)), ("labels", "int32", (BATCH,)),
          ("index", "int64", (BATCH,)), ("epoch", "int32", (BATCH,))]


def _nbytes() -> list[int]:
    import numpy as np

    return [int(np.prod(shape)) * np.dtype(dtype).itemsize for _, dtype, shape in LAYOUT]


def serve(port_file: str) -> None:
    """Sender: accept one trainer at a time and send the same batch until it hangs up."""
    import numpy as np

    rng = np.random.default_rng(0)
    payload = b"".join(rng.integers(0, 255, n, dtype=np.uint8).tobytes() for n in _nbytes())
    listener = socket.create_server(("127.0.0.1", 0))
    Path(port_file).write_text(str(listener.getsockname()[1]))
    while True:
        conn, _ = listener.accept()
        with conn:
            try:
                while True:
                    conn.sendall(payload)
            except OSError:
                pass  # the trainer closed: wait for the next one


def _recv_exactly(conn: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        got = conn.recv_into(view)
        if not got:
            raise ConnectionError("sender closed")
        view = view[got:]


def raw_bare(port: int, warmup: int, batches: int) -> tuple[float, float]:
    """(images/s, cpu s per GB): recv_into one reused buffer per array."""
    import numpy as np

    sizes = _nbytes()
    buffers = [memoryview(np.empty(n, np.uint8)) for n in sizes]
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        for i in range(warmup + batches):
            if i == warmup:
                t0, c0 = time.perf_counter(), own_cpu_seconds()
            for b in buffers:
                _recv_exactly(conn, b)
        seconds, cpu = time.perf_counter() - t0, own_cpu_seconds() - c0
    return batches * BATCH / seconds, cpu / (batches * sum(sizes) / 1e9)


def raw_tensorflow(port: int, warmup: int, batches: int) -> tuple[float, float]:
    """(images/s, cpu s per GB): recv_into pooled aligned buffers -> DLPack -> FIFOQueue -> staged step."""
    import numpy as np
    import tensorflow as tf

    from stoker.consumer.tf.staging import StagingArea
    from stoker.consumer.tf.tensor_import import TensorImporter

    sizes = _nbytes()
    dtypes = [tf.as_dtype(d) for _, d, _ in LAYOUT]
    queue = tf.queue.FIFOQueue(50, dtypes, shapes=[list(s) for _, _, s in LAYOUT])
    staging = StagingArea(dtypes, "/cpu:0", capacity=2)
    importer = TensorImporter()  # the pool ZMQInput uses
    stop = threading.Event()

    def receive(conn: socket.socket) -> None:
        try:
            while not stop.is_set():
                tensors = []
                for _, dtype, shape in LAYOUT:
                    array = importer.empty(np.dtype(dtype), shape)
                    _recv_exactly(conn, memoryview(array.reshape(-1).view(np.uint8)))
                    tensors.append(importer.own(array))
                tf.raw_ops.QueueEnqueueV2(handle=queue.queue_ref, components=tensors)
        except (tf.errors.CancelledError, ConnectionError, OSError):
            pass

    @tf.function
    def step():
        current = staging.get()
        staging.put(queue.dequeue())
        return tf.shape(current[0])[0]

    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        thread = threading.Thread(target=receive, args=(conn,), daemon=True)
        thread.start()
        staging.put(queue.dequeue())
        images = 0
        for i in range(warmup + batches):
            if i == warmup:
                t0, c0 = time.perf_counter(), own_cpu_seconds()
            n = int(step())
            if i >= warmup:
                images += n
        seconds, cpu = time.perf_counter() - t0, own_cpu_seconds() - c0
        stop.set()
        queue.close(cancel_pending_enqueues=True)
        conn.shutdown(socket.SHUT_RDWR)
        thread.join(30)
    return images / seconds, cpu / (batches * sum(sizes) / 1e9)


def _child(mode: str, target: str, warmup: int, batches: int) -> tuple[float, float]:
    """Run one receiver in a fresh process (one TensorFlow per measurement, as a trainer has)."""
    out = subprocess.run([sys.executable, __file__, "--measure", mode, "--target", target, "--warmup", str(warmup),
                          "--batches", str(batches)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{out.stderr[-2000:]}")
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))  # type: ignore[return-value]


def measure(mode: str, target: str, warmup: int, batches: int) -> tuple[float, float]:
    from delivery import bare_receive, zmq_input_receive

    if mode == "raw_bare":
        return raw_bare(int(target), warmup, batches)
    if mode == "raw_tf":
        return raw_tensorflow(int(target), warmup, batches)
    if mode == "zmq_bare":
        images, _, cpu = bare_receive([target], warmup, batches)
        return images, cpu
    images, _, cpu = zmq_input_receive([target], BATCH, SIZE, warmup, batches)
    return images, cpu


MODES = {"raw_bare": "raw TCP, bare", "raw_tf": "raw TCP into TensorFlow", "zmq_bare": "pyzmq, bare",
         "zmq_input": "ZMQInput"}


def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is kept")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batches", type=int, default=300)
    add_out_argument(parser, "raw_receive_probe.json")
    parser.add_argument("--serve", metavar="PORT_FILE", help=argparse.SUPPRESS)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    return parser.parse_args()


def _start_sender(port_file: Path) -> tuple[subprocess.Popen, str]:
    """This script as the raw sender (``--serve``); the process and the port it listens on."""
    sender = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file)])
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline or sender.poll() is not None:
            sender.kill()
            sender.wait(30)
            raise RuntimeError("the raw sender did not start")
        time.sleep(0.05)
    return sender, port_file.read_text()


def run_rounds(args) -> dict[str, list[tuple[float, float]]]:
    """(images/s, CPU s per GB) of every receiver per round, each in a fresh process."""
    from stoker.producer.dataset.build.synthetic import build_synthetic

    results: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        sender, port = _start_sender(Path(tmp) / "port")
        try:
            build_synthetic(Path(tmp) / "ds", 64, seed=0, progress=False)
            flags = producer_flags(BATCH, SIZE, repeat_batches=True, seed=0)
            with launch_producer(Path(tmp) / "ds", flags) as producer:
                for r in range(args.rounds):
                    for mode in MODES:
                        target = port if mode.startswith("raw") else producer.endpoint
                        results[mode].append(_child(mode, target, args.warmup, args.batches))
                    print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                        f"{m} {v[-1][0]:.0f}" for m, v in results.items()), flush=True)
        finally:
            sender.kill()
            sender.wait(30)
    return results


def main() -> None:
    args = parse_args()
    if args.serve:
        return serve(args.serve)
    if args.measure:
        print(json.dumps(measure(args.measure, args.target, args.warmup, args.batches)))
        return
    results = run_rounds(args)
    median = {m: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for m, v in results.items()}
    print(f"\ntrainer receive paths, {BATCH} x {SIZE} px batches on loopback, median of {args.rounds} interleaved rounds")
    print(f"{'receiver':>26} | {'images/s':>8} | {'CPU s/GB':>8}")
    print("-" * 48)
    for m, label in MODES.items():
        print(f"{label:>26} | {median[m][0]:>8.0f} | {median[m][1]:>8.3f}")
    raw_ratio = median["raw_tf"][0] / median["raw_bare"][0]
    vs_zmq = median["raw_tf"][0] / median["zmq_bare"][0]
    zmq_ratio = median["zmq_input"][0] / median["zmq_bare"][0]
    print(f"raw into TensorFlow / raw bare {raw_ratio:.3f}; / pyzmq bare {vs_zmq:.3f}; ZMQInput / pyzmq bare {zmq_ratio:.3f}")
    result = {"benchmark": "raw_receive_probe", "median": {m: {"images_per_s": a, "cpu_s_per_gb": b}
                                                          for m, (a, b) in median.items()},
              "rounds": {m: [list(x) for x in v] for m, v in results.items()}, "raw_tf_over_raw_bare": raw_ratio,
              "raw_tf_over_zmq_bare": vs_zmq, "zmq_input_over_zmq_bare": zmq_ratio, **machine_info()}
    write_results(args.out, result)


if __name__ == "__main__":
    main()
