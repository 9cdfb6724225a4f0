"""``ProducerFleet``: many producer endpoints in one process, driven by one thread.

A daemon's forwarding thread per endpoint would be a thousand threads each waking every 2 ms while slots are in
flight; here one loop does every endpoint's turn over one poll: each forwarder's ``before_poll`` (slots libzmq
released, granted back), one ``zmq.Poller`` over every endpoint's sockets, then ``after_poll`` and the worker's
grants for the endpoints the poll woke. The forwarders, their slots and sockets are the daemon's
(endpoint.py); only the loop is the fleet's.

Limits a thousand sockets meet are raised at start: libzmq's sockets per context (``zmq.MAX_SOCKETS``, 1,023 by
default) to what the endpoints need, and the soft limit on open files (``RLIMIT_NOFILE``) to the hard one; an
OSError naming ``ulimit -n`` when even that is too low.

Status, as a daemon's (status_file.py): one "serving" line per endpoint once all are bound, one "stopped" line for
the process (``endpoints``, ``batches`` made to send).
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading
from dataclasses import dataclass
from typing import Optional

import zmq

from stoker.producer.fleet.endpoint import SOCKETS_PER_ENDPOINT, FleetEndpoint
from stoker.producer.serve.sharding import ShardSpec
from stoker.producer.serve.status_file import StatusFile

log = logging.getLogger("stoker.producer.fleet")

FILES_PER_ENDPOINT = 6  # three sockets' mailboxes, the listener, a trainer's connection, a spare
_IDLE_POLL_MS = 100


@dataclass(frozen=True)
class FleetConfig:
    """Endpoints ``first .. first + count - 1`` of a fleet of ``of``; endpoint ``i`` serves shard ``i/of`` of a
    synthetic dataset of ``records x of`` records in batches of ``batch_size`` images of ``image_size`` px.

    ``base_port``: endpoint ``i`` binds ``host:base_port + i``; 0: any free port (the status file says which).
    """

    first: int
    count: int
    of: int
    host: str = "127.0.0.1"
    base_port: int = 0
    records: int = 1024
    batch_size: int = 32
    image_size: int = 8
    classes: int = 10
    seed: int = 0
    sndhwm: int = 2
    status_file: Optional[str] = None

    def __post_init__(self) -> None:
        if not (self.count >= 1 and self.of >= 1 and 0 <= self.first and self.first + self.count <= self.of):
            raise ValueError(f"endpoints {self.first}..{self.first + self.count - 1} are not within a fleet of "
                             f"{self.of}: need count >= 1 and first + count <= of")
        if self.records < 1 or self.batch_size < 1 or self.image_size < 1 or self.classes < 1 or self.sndhwm < 1:
            raise ValueError("records, batch size, image size, classes and sndhwm must each be >= 1")
        if not 0 <= self.base_port <= 65535 - self.of:
            raise ValueError(f"--base-port {self.base_port} leaves no room for {self.of} ports below 65536")

    def bind(self, shard: int) -> str:
        return f"tcp://{self.host}:{self.base_port + shard if self.base_port else '*'}"


def raise_open_files_limit(needed: int) -> None:
    """The soft RLIMIT_NOFILE raised to the hard limit when below ``needed``; OSError naming ``ulimit -n`` when
    the hard limit is below it too."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise OSError(errno.EMFILE, f"a fleet process needs about {needed} open files but may open at most {hard}: "
                      f"raise the limit (ulimit -n {needed}) or run fewer endpoints per process")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class ProducerFleet:
    """``config.count`` endpoints bound at construction (BindError, OSError for too few files: nothing stays
    open); ``run(stop)`` serves them from the calling thread until ``stop`` is set, then closes everything."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        raise_open_files_limit(config.count * FILES_PER_ENDPOINT + 64)
        self.status = StatusFile(config.status_file)
        self._ctx = zmq.Context()
        self._ctx.set(zmq.MAX_SOCKETS, config.count * SOCKETS_PER_ENDPOINT + 64)
        self.endpoints: list[FleetEndpoint] = []
        try:
            for shard in range(config.first, config.first + config.count):
                self.endpoints.append(FleetEndpoint(
                    self._ctx, config.bind(shard), ShardSpec(shard, config.of), config.records, config.seed,
                    config.batch_size, config.image_size, config.classes, config.sndhwm))
        except BaseException:
            self._close()
            raise
        for endpoint in self.endpoints:
            self.status.write("serving", **endpoint.serving_fields())
        log.info("fleet serving %d endpoints (shards %d..%d of %d), pid %d", config.count, config.first,
                 config.first + config.count - 1, config.of, os.getpid())

    @property
    def batches(self) -> int:
        """Batches made to send, over every endpoint."""
        return sum(endpoint.worker.batches for endpoint in self.endpoints)

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; then close every socket and write "stopped". An error in the loop (a bug)
        propagates after the same closing."""
        try:
            self._serve(stop)
        finally:
            self.status.write("stopped", endpoints=len(self.endpoints), batches=self.batches, images=self.batches *
                              self.config.batch_size, skipped=0, restarts=0)
            self._close()

    def _serve(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        owner: dict[zmq.Socket, FleetEndpoint] = {}
        for endpoint in self.endpoints:
            for sock in (endpoint.control, endpoint.worker.sock, endpoint.out):
                owner[sock] = endpoint
            poller.register(endpoint.control, zmq.POLLIN)
            poller.register(endpoint.worker.sock, zmq.POLLIN)
        while not stop.is_set():
            wait = _IDLE_POLL_MS
            for endpoint in self.endpoints:
                events = endpoint.forwarder.before_poll()
                if events != endpoint.out_events:
                    poller.register(endpoint.out, events)  # 0 unregisters it: nothing to send
                    endpoint.out_events = events
                wait = min(wait, endpoint.forwarder.poll_ms)
            ready = dict(poller.poll(wait))
            for endpoint in {owner[sock] for sock in ready}:
                if ready.get(endpoint.worker.sock, 0) & zmq.POLLIN:
                    endpoint.worker.on_grants()
                endpoint.forwarder.after_poll(ready)

    def _close(self) -> None:
        for endpoint in self.endpoints:
            endpoint.close()
        self._ctx.destroy(linger=0)  # also closes an endpoint's sockets that failed half-way through binding
        self.status.close()
