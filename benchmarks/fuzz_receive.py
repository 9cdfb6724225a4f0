"""Fuzz direct receive: mutated and truncated ZMTP streams from a raw peer, next to a real libzmq producer.

Each stream starts from a valid one (greeting, READY, a few batches whose images are all
``seq % 256`` and whose indices are ``seq * B ...``; as a ROUTER for ``--socket-type DEALER``,
exact mode's link, with producer statuses between them) and gets 1-3 seeded structural mutations:
truncation, flipped bits in greetings, READY properties, frame flags and sizes and headers,
long or huge lengths, MORE set or cleared, frames dropped or repeated, commands (PING,
unknown, oversized) and garbage inserted. The real receiving code (``ZMTPConnection`` +
``read_message``) reads each stream until it ends or is dropped. Meanwhile a real libzmq PUSH
socket feeds a ``BatchStream`` (the same receive core) whose batches must keep arriving intact.

Counted: crashes (an exception other than the protocol/connection errors the code raises by
contract), hangs (a stream that did not end within ``--stream-s`` after the peer closed it),
corrupted or mixed batches delivered (images not uniform, or not matching their indices),
RSS growth. Prints a table and writes JSON (``benchmarks/results/fuzz_receive.json``).

    python benchmarks/fuzz_receive.py --streams 100000 [--socket-type DEALER]
"""

from __future__ import annotations

import random
import resource
import socket
import struct
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np

from harness import add_out_argument, benchmark_parser, write_json
from stoker.consumer.transport.direct_receive import read_message
from stoker.consumer.receive.contract import aligned_empty
from stoker.consumer.transport.zmtp import Stopped, ZMTPConnection
from stoker.protocol import DecodeLimits, ProtocolError, encode_batch
from stoker.protocol.batch_spec import BatchSpec
from stoker.protocol.exact_messages import Status, decode_status, encode_status

B, SHAPE = 4, (8, 8, 3)
GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + b"\0" * 31
SPEC = BatchSpec.from_dict({"images": ("uint8", [B, *SHAPE]), "labels": ("int32", [B]), "index": ("int64", [B]),
                            "epoch": ("int32", [B])})
LIMITS = DecodeLimits(max_message_bytes=64 * 1024)
PEER = {"PULL": b"PUSH", "DEALER": b"ROUTER"}
STATUS = encode_status(Status("0/1:100:0", "fuzz", 0, 1, False, spec=[["images", "uint8", [B, *SHAPE]]], session=1))


def _command(body: bytes) -> bytes:
    return (bytes([0x04, len(body)]) if len(body) < 256 else b"\x06" + struct.pack(">Q", len(body))) + body


def _ready(socket_type: bytes = b"PUSH") -> bytes:
    return _command(b"\x05READY" + bytes([11]) + b"Socket-Type" + struct.pack(">I", len(socket_type)) + socket_type)


def batch_frames(seq: int) -> list[bytes]:
    arrays = {"images": np.full((B, *SHAPE), seq % 256, np.uint8), "labels": np.arange(B, dtype=np.int32),
              "index": np.arange(seq * B, (seq + 1) * B, dtype=np.int64), "epoch": np.zeros(B, np.int32)}
    return [bytes(memoryview(f)) for f in encode_batch(arrays, producer="fuzz", seq=seq)]


def intact(batch: dict[str, np.ndarray]) -> bool:
    """A delivered batch is one message's, unmixed: uniform images that match its indices."""
    images, index = batch["images"], batch["index"]
    seq = int(index[0]) // B
    return bool((images == seq % 256).all() and (index == np.arange(seq * B, (seq + 1) * B)).all())


def mutated_stream(rng: random.Random, peer: bytes = b"PUSH") -> bytes:
    """A valid stream's tokens (greeting, READY, frames) with 1-3 structural mutations, as bytes."""
    # ["raw", bytes] or ["frame", flags, body, is_header, lying size or None]. Array bytes are never changed: a
    # batch delivered from a mutated stream must still be one whole message's, which ``intact`` can tell.
    tokens: list[list] = [["raw", GREETING], ["raw", _ready(peer)]]
    for _ in range(rng.randint(1, 3)):
        if peer == b"ROUTER" and rng.random() < 0.5:  # exact mode: a producer's status between batches
            tokens.append(["frame", 0, STATUS, True, None])
        frames = batch_frames(rng.randrange(1000))
        for i, body in enumerate(frames):
            tokens.append(["frame", int(i < len(frames) - 1), body, i == 0, None])
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(10)
        i = rng.randrange(len(tokens))
        tok = tokens[i]
        if op == 0 and tok[0] == "raw":  # flip a bit of the greeting or READY
            data = bytearray(tok[1])
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            tok[1] = bytes(data)
        elif op == 1 and tok[0] == "frame":  # flags: any bits
            tok[1] = rng.randrange(256)
        elif op == 2 and tok[0] == "frame":  # a lying length, short or long form
            tok[4] = rng.choice([0, 1, 255, 256, 2**31, 2**63 - 1, rng.randrange(2**20)])
        elif op == 3 and tok[0] == "frame":  # MORE toggled
            tok[1] ^= 0x01
        elif op == 4:
            del tokens[i]
        elif op == 5:
            tokens.insert(i, list(tok))
        elif op == 6:  # a command: PING, unknown, ERROR, or one too long
            body = rng.choice([b"\x04PING\x00\x01ctx", b"\x07UNKNOWN", b"\x05ERROR\x03bad", b"\x04PING" * 2000])
            tokens.insert(i, ["raw", _command(body)])
        elif op == 7:  # garbage
            tokens.insert(i, ["raw", rng.randbytes(rng.randrange(1, 64))])
        elif op == 8 and tok[0] == "frame" and tok[3] and tok[2]:  # flip a bit in a header frame
            data = bytearray(tok[2])
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            tok[2] = bytes(data)
        elif op == 9 and i > 1:  # READY of another socket type, or a second READY
            tokens.insert(i, ["raw", _ready(rng.choice([b"ROUTER", b"PUB", b"PUSH"]))])
    out = bytearray()
    for tok in tokens:
        if tok[0] == "raw":
            out += tok[1]
        else:
            flags, body = tok[1], tok[2]
            size = tok[4] if tok[4] is not None else len(body)
            out += (bytes([flags | 0x02]) + struct.pack(">Q", size)) if size > 255 or flags & 0x02 else \
                bytes([flags & ~0x02, size])
            out += body
    if rng.random() < 0.3:  # truncated anywhere
        del out[rng.randrange(len(out)):]
    return bytes(out)


@dataclass
class FuzzResult:
    streams: int = 0
    batches_delivered: int = 0
    statuses: int = 0  # exact mode's status messages read (DEALER)
    rejected: int = 0
    crashes: int = 0
    hangs: int = 0
    corrupted: int = 0
    crash_examples: list[str] = field(default_factory=list)
    producer_batches: int = 0
    producer_corrupted: int = 0
    rss_start_mib: float = 0.0
    rss_peak_mib: float = 0.0
    seconds: float = 0.0


class _Server:
    """Serves one queued stream per accepted connection, then closes it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        self.pending: list[bytes] = []
        self.ready = threading.Semaphore(0)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.ready.acquire()
            data = self.pending.pop()
            if data is None:
                return
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(5)
                    conn.sendall(data)
                    conn.shutdown(socket.SHUT_WR)
                    conn.recv(1 << 16)  # until the reader closes (or 5 s)
                except OSError:
                    pass

    def serve(self, data: Optional[bytes]) -> None:
        self.pending.append(data)  # type: ignore[arg-type]
        self.ready.release()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def run(streams: int, seed: int, stream_s: float = 5.0, with_producer: bool = True,
        socket_type: str = "PULL") -> FuzzResult:
    """Fuzz ``streams`` mutated streams (see the module doc) read as ``socket_type`` (PULL: plain direct
    receive; DEALER: exact mode's link, statuses too); the result counts what went wrong."""
    rng = random.Random(seed)
    result = FuzzResult(rss_start_mib=_rss_mib())
    server = _Server()
    feeder = _ProducerFeed() if with_producer else None
    started = time.monotonic()
    try:
        for n in range(streams):
            server.serve(mutated_stream(rng, PEER[socket_type]))
            result.streams = n + 1
            deadline = time.monotonic() + stream_s
            try:
                conn = ZMTPConnection(server.endpoint, lambda: time.monotonic() > deadline, poll_s=0.01,
                                      connect_timeout=stream_s, stall_s=stream_s / 2, socket_type=socket_type)
            except Stopped:
                result.hangs += 1
                continue
            except (OSError, ProtocolError):
                result.rejected += 1
                continue
            except Exception as exc:  # noqa: BLE001 - counting what the contract does not allow
                result.crashes += 1
                result.crash_examples.append(f"stream {n} (handshake): {exc!r}")
                continue
            try:
                while True:
                    try:
                        batch = read_message(conn, SPEC, LIMITS, aligned_empty, statuses=socket_type == "DEALER")
                        if isinstance(batch, tuple):
                            decode_status(batch[0])  # as the transport validates a status
                        else:
                            SPEC.check(batch)
                    except ProtocolError:
                        result.rejected += 1
                        if not conn.in_sync:
                            break
                        continue
                    if isinstance(batch, tuple):
                        result.statuses += 1
                        continue
                    result.batches_delivered += 1
                    if not intact(batch.arrays):
                        result.corrupted += 1
            except Stopped:
                result.hangs += 1
            except (OSError, ConnectionError):
                pass  # the stream ended or was dropped: by contract
            except Exception as exc:  # noqa: BLE001
                result.crashes += 1
                result.crash_examples.append(f"stream {n}: {exc!r}")
            finally:
                conn.close()
            if n % 1000 == 0:
                result.rss_peak_mib = max(result.rss_peak_mib, _rss_mib())
    finally:
        server.serve(None)
        server.sock.close()
        if feeder is not None:
            result.producer_batches, result.producer_corrupted = feeder.stop()
    result.rss_peak_mib = max(result.rss_peak_mib, _rss_mib())
    result.seconds = time.monotonic() - started
    return result


class _ProducerFeed:
    """A real libzmq PUSH socket feeding a BatchStream throughout; counts intact and broken batches."""

    def __init__(self) -> None:
        import zmq

        from stoker.consumer.numpy.batch_stream import BatchStream

        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 4)
        port = self._push.bind_to_random_port("tcp://127.0.0.1")
        self._stream = BatchStream([f"tcp://127.0.0.1:{port}"], spec={a.name: (a.dtype, a.shape) for a in SPEC.arrays},
                                   recv_timeout=120)
        self._stop = threading.Event()
        self.received = self.broken = 0
        self._threads = [threading.Thread(target=self._send, daemon=True),
                         threading.Thread(target=self._receive, daemon=True)]
        for t in self._threads:
            t.start()

    def _send(self) -> None:
        import zmq

        seq = 0
        while not self._stop.is_set():
            try:
                self._push.send_multipart(batch_frames(seq), flags=zmq.NOBLOCK)
                seq += 1
            except zmq.Again:
                time.sleep(0.01)
            time.sleep(0.002)

    def _receive(self) -> None:
        from stoker.consumer.receive.errors import InputClosedError

        try:
            for batch in self._stream:
                self.received += 1
                self.broken += not intact(batch)
                if self._stop.is_set():
                    return
        except InputClosedError:
            return  # stop() closed the stream while this thread waited for a batch: the expected end

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        for t in self._threads:
            t.join(5)
        self._stream.close()
        self._push.close(0)
        self._ctx.term()
        return self.received, self.broken


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--streams", type=int, default=100_000, help="mutated streams (default 100000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--socket-type", choices=sorted(PEER), default="PULL",
                        help="read as plain direct receive (PULL) or as exact mode's link (DEALER)")
    parser.add_argument("--stream-s", type=float, default=5.0, help="seconds a stream may take after its peer closed")
    add_out_argument(parser, "fuzz_receive.json")
    args = parser.parse_args()
    result = run(args.streams, args.seed, args.stream_s, socket_type=args.socket_type)
    rows = [("socket type", args.socket_type), ("streams", result.streams),
            ("batches delivered from them", result.batches_delivered), ("statuses read", result.statuses),
            ("rejected (counted)", result.rejected), ("crashes", result.crashes), ("hangs", result.hangs),
            ("corrupted or mixed batches", result.corrupted),
            ("real producer's batches received", result.producer_batches),
            ("  of them corrupted", result.producer_corrupted),
            ("RSS start / peak MiB", f"{result.rss_start_mib:.0f} / {result.rss_peak_mib:.0f}"),
            ("seconds", f"{result.seconds:.0f}")]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for example in result.crash_examples[:5]:
        print("crash:", example)
    write_json(args.out, asdict(result), end="\n")
    sys.exit(1 if result.crashes or result.hangs or result.corrupted or result.producer_corrupted else 0)


if __name__ == "__main__":
    main()
