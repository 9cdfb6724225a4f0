"""One producer endpoint of a fleet: the daemon's serving half, with its worker in the same process.

    SyntheticWorker --[ready, slot, header]--> ROUTER (inproc) --> SlotForwarder --[header, slot]--> PUSH (tcp)
                    <--------[grant, slot]---- ROUTER <----------

Everything after the daemon's seam is the daemon's own: the serving policy the daemon would choose (``policy_for``:
``PlainPolicy``; in exact mode ``FixedShardPolicy``, or ``PoolPolicy`` for ``--shard auto``) makes the forwarder
(``SlotForwarder``, or ``ExactForwarder``) over the endpoint's slots (``SlotLayout``, ``sndhwm + 1`` of them), a PUSH
(exact: ROUTER) bound on TCP with the daemon's socket options, its producer id (``default_producer_id``) and its
stream (shard ``I/N`` of the fleet's synthetic dataset, or a pool's ``splits:...`` of all of it, in the order
``pool_order`` settles). Only the worker process is replaced (synthetic_worker.py). The endpoint owns no thread:
the fleet's loop drives it (fleet.py).
"""

from __future__ import annotations

import secrets

import zmq

from stoker.protocol.input_state import StreamKey

from stoker.producer.fleet.fleet_config import FleetConfig
from stoker.producer.fleet.synthetic_worker import SyntheticWorker, synthetic_arrays
from stoker.producer.serve.batch_slots import SlotLayout
from stoker.producer.serve.daemon import BindError, default_producer_id
from stoker.producer.serve.producer_config import pool_order
from stoker.producer.serve.forwarder import SlotForwarder
from stoker.producer.serve.policies.choice import policy_for

SOCKETS_PER_ENDPOINT = 3  # the PUSH, the forwarder's ROUTER, the worker's DEALER


class FleetEndpoint:
    """Endpoint ``shard`` of the fleet ``config`` describes, bound and ready to be driven. BindError (the daemon's)
    names an address that cannot be bound; its socket is closed then (the fleet destroys the context)."""

    def __init__(self, ctx: zmq.Context, config: FleetConfig, shard: int) -> None:
        settings = config.producer_config(shard)  # ValueError for settings a daemon would refuse
        self.shard, self.exact, self.epochs = settings.shard, settings.exact, settings.epochs
        self.out = ctx.socket(zmq.ROUTER if settings.exact else zmq.PUSH)  # the daemon's socket and options
        self.out.setsockopt(zmq.SNDHWM, settings.sndhwm)
        self.out.setsockopt(zmq.LINGER, 0)
        if settings.exact:
            self.out.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.out.bind(settings.bind)
        except zmq.ZMQError as exc:
            self.out.close(linger=0)
            raise BindError(f"cannot bind {settings.bind}: {exc.strerror}; pick free ports (--base-port) or 0 for "
                            "any") from None
        self.endpoint = self.out.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.producer_id = default_producer_id(self.endpoint, self.shard)  # a pool's: HOST:PORT#auto~INSTANCE
        self.key = StreamKey(self.shard.index, self.shard.count, config.dataset_records, settings.seed or 0,
                             splits=self.shard.auto, order_version=pool_order(settings, config.dataset_records))
        self.control = ctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.control.setsockopt(zmq.LINGER, 0)
        internal = f"inproc://stoker-fleet-{shard}-{secrets.token_hex(4)}"
        self.control.bind(internal)
        self.layout = SlotLayout(synthetic_arrays(config.image_size, settings.exact), config.batch_size,
                                 slots=settings.sndhwm + 1)
        spec = [(name, dtype, [config.batch_size, *shape]) for name, dtype, shape in self.layout.arrays]
        self.policy = policy_for(settings, self.key, self.producer_id, spec)
        buffer = bytearray(self.layout.slots * self.layout.slot_bytes)  # one process: no shared memory needed
        self.forwarder: SlotForwarder = self.policy.forwarder(self.control, self.out, self.layout, [buffer])
        routing_id = b"w" + secrets.token_bytes(8)
        self.forwarder.register_worker(0, routing_id)
        self.worker = SyntheticWorker(ctx, internal, routing_id, self.layout, buffer, self.key, self.producer_id,
                                      config.classes)
        self.out_events = 0  # what the fleet's poller watches ``out`` for now

    def serving_fields(self) -> dict[str, object]:
        """The daemon's "serving" status fields for this endpoint (status_file.py's format)."""
        return {"endpoint": self.endpoint, "producer_id": self.producer_id, "mode": self.policy.mode,
                "epochs": self.epochs, "shard": str(self.shard), "records": self.key.size, "seed": self.key.seed,
                "workers": 1, "metrics_port": None}

    def close(self) -> None:
        self.worker.close()
        for sock in (self.control, self.out):
            sock.close(linger=0)
