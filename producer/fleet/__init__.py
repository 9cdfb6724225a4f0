"""A producer fleet on one machine: many producer endpoints in a few processes, for tests and benchmarks.

Each endpoint is the daemon's real serving code (the policy ``policy_for`` chooses: plain, exact mode's fixed
shard, or an elastic pool's producer with ``--pool``; its forwarder, slots, socket, producer id, stream and status lines: endpoint.py, with its settings in
fleet_config.py) fed by an in-process synthetic worker instead of worker processes (synthetic_worker.py): the same
control messages, the real batch codec, cheap batches whose pixels say their record. One thread per process drives
every endpoint over one poll (fleet.py), so 1,024 producers fit in a few processes on two cores.
``python -m stoker.producer.fleet`` is one process (``__main__.py``); ``FleetProcesses``
(launcher.py) starts several and waits until every endpoint serves.
"""
