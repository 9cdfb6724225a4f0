"""``ProducerFleet``: many producer endpoints in one process, driven by one thread.

A daemon's forwarding thread per endpoint would be a thousand threads each waking every 2 ms while slots are in
flight; here one loop does every endpoint's turn over one poll: each forwarder's ``before_poll`` (slots libzmq
released, granted back), one ``zmq.Poller`` over every endpoint's sockets, then ``after_poll`` and the worker's
grants for the endpoints the poll woke, and for every endpoint at least every ``IDLE_POLL_MS`` (an exact
forwarder's own loop turns that often for its timers: trainers' expiry, statuses). The forwarders, their slots
and sockets are the daemon's (endpoint.py); only the loop is the fleet's.

Limits a thousand sockets meet are raised at start: libzmq's sockets per context (``zmq.MAX_SOCKETS``, 1,023 by
default) to what the endpoints need, and the soft limit on open files (``RLIMIT_NOFILE``) to the hard one; an
OSError naming ``ulimit -n`` when even that is too low (``protocol/descriptors.py``).

Status, as a daemon's (status_file.py): one "serving" line per endpoint once all are bound, one "stopped" line for
the process (``endpoints``, ``batches`` made to send).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zmq

from stoker.producer.fleet.endpoint import SOCKETS_PER_ENDPOINT, FleetEndpoint
from stoker.producer.fleet.fleet_config import FleetConfig
from stoker.producer.serve.exact_forwarder import IDLE_POLL_MS
from stoker.producer.serve.status_file import StatusFile
from stoker.protocol.descriptors import raise_open_files_limit

log = logging.getLogger("stoker.producer.fleet")

FILES_PER_ENDPOINT = 6  # three sockets' mailboxes, the listener, a trainer's connection, a spare


class ProducerFleet:
    """``config.count`` endpoints bound at construction (BindError, OSError for too few files: nothing stays
    open); ``run(stop)`` serves them from the calling thread until ``stop`` is set, then closes everything."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        raise_open_files_limit(config.count * FILES_PER_ENDPOINT + 64, f"a fleet process's {config.count} endpoints",
                               "run fewer endpoints per process")
        self.status = StatusFile(config.status_file)
        self._ctx = zmq.Context()
        self._ctx.set(zmq.MAX_SOCKETS, config.count * SOCKETS_PER_ENDPOINT + 64)
        self.endpoints: list[FleetEndpoint] = []
        try:
            for shard in range(config.first, config.first + config.count):
                self.endpoints.append(FleetEndpoint(self._ctx, config, shard))
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
        every_turn_at = 0.0
        while not stop.is_set():
            wait = IDLE_POLL_MS
            for endpoint in self.endpoints:
                events = endpoint.forwarder.before_poll()
                if events != endpoint.out_events:
                    poller.register(endpoint.out, events)  # 0 unregisters it: nothing to send
                    endpoint.out_events = events
                wait = min(wait, endpoint.forwarder.poll_ms)
            ready = dict(poller.poll(wait))
            woken = {owner[sock] for sock in ready}
            now = time.monotonic()
            if now >= every_turn_at:  # an exact forwarder's timers (expiry, statuses) need a turn this often
                every_turn_at = now + IDLE_POLL_MS / 1000
                woken = set(self.endpoints)
            for endpoint in woken:
                if ready.get(endpoint.worker.sock, 0) & zmq.POLLIN:
                    endpoint.worker.on_grants()
                endpoint.forwarder.after_poll(ready)

    def _close(self) -> None:
        for endpoint in self.endpoints:
            endpoint.close()
        self._ctx.destroy(linger=0)  # also closes an endpoint's sockets that failed half-way through binding
        self.status.close()
