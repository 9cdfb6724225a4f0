"""The producer daemon: N worker processes behind one bound ZMQ socket (PUSH; exact mode ROUTER).

    workers (spawn) --decode into--> shared slots --SlotForwarder thread, copy=False--> PUSH bind --> trainers
                    <--ipc control (ready / grant)-->

Exact mode (``--exact``, ``--epochs N``, or ``--shard auto`` for an elastic pool) binds a ROUTER
instead, and a serving policy (``policies/``, chosen by ``policy_for``: ``FixedShardPolicy`` for fixed shards,
``PoolPolicy`` for a pool, both over one ``TrainerRegistry``) decides which trainer gets each batch, against the
credit that trainer gave, and re-serves the records of a trainer that went away.

Workers write each batch into shared memory and announce it; the daemon sends
that memory itself, so a batch is copied once (into the kernel's TCP buffer)
rather than passing through an ipc hop (see batch_slots.py and forwarder.py).
Each worker has ``sndhwm + 1`` slots, allocated at start, which bounds memory;
when the trainer is slow the PUSH socket fills, slots stay queued, and workers
wait for a free one: backpressure. ``run()`` returns after ``stop`` is set
(SIGTERM/SIGINT in the CLI) with every worker joined, killed if need be, and
the ipc socket file removed, in well under 2 s.

Its settings are a ``ProducerConfig`` (producer_config.py, where they are checked and settled). The status
file (``--status-file``) is the channel for programs: its format is status_file.py's docstring.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from dataclasses import replace
from typing import Optional

import zmq

from stoker.protocol.peer_ids import with_instance
from stoker.protocol.input_state import StreamKey, check_materialisable
from stoker.protocol.metrics_server import MetricsServer

from stoker.producer.serve.batch_slots import SlotLayout, allocate
from stoker.producer.dataset.sources import RecordSource, open_dataset
from stoker.producer.dataset.sources.record_source import shown_location, source_kind
from stoker.producer.serve.forwarder import SlotForwarder
from stoker.producer.serve.policies.choice import policy_for
from stoker.producer.measure.metrics import ProducerCollector
from stoker.producer.pipeline import load_pipeline
from stoker.producer.serve.logs import counted
from stoker.producer.serve.peer_security import HandshakeFailureLog, RefusalLoggingAuthenticator
from stoker.producer.serve.policies.serving_policy import ServingPolicy
from stoker.producer.serve.producer_config import ProducerConfig, check_shard_size, pool_order, settled
from stoker.producer.serve.block_layout import BlockHoldings
from stoker.producer.serve.sharding import ShardSpec, layout_block
from stoker.producer.serve.status_file import StatusFile
from stoker.producer.measure.stage_stats import StageStats, rate_report
from stoker.producer.serve.worker import WorkerConfig, run_worker
from stoker.producer.supervision.restart_policy import MAX_SKIPPED_RECORDS
from stoker.producer.supervision.worker_progress import WorkerProgress
from stoker.producer.supervision.worker_supervisor import WorkerSupervisor

log = logging.getLogger("stoker.producer")


def _control_endpoint() -> tuple[Optional[str], str]:
    """``(folder to remove or None, endpoint)`` of the workers' control socket.

    On Linux an abstract-namespace socket: no file at all, so even a SIGKILLed daemon leaves
    nothing behind. Elsewhere a socket file in a fresh temporary folder, removed on exit.
    """
    if sys.platform.startswith("linux"):
        return None, f"ipc://@stoker-producer-{os.getpid()}-{secrets.token_hex(8)}"
    folder = tempfile.mkdtemp(prefix="stoker-producer-")
    return folder, f"ipc://{folder}/workers.sock"


def default_producer_id(endpoint: str, shard: ShardSpec) -> str:
    """``HOST:PORT#SHARD~INSTANCE``: unique per daemon instance, within the header's 128-character id limit.

    ``INSTANCE`` is 6 random hex digits (``with_instance``): producers on one port number in different network
    namespaces, containers with host networking or cloned VMs share ``HOST:PORT#SHARD``, and a trainer's stats
    must not merge them; a restarted producer is a new instance. ``--id`` replaces the whole id.
    """
    host = "".join(c for c in socket.gethostname() if "!" <= c <= "~")  # printable ASCII, no spaces
    return with_instance(f"{host}:{endpoint.rsplit(':', 1)[-1]}#{shard}")


def _bind_advice(bind: str, why: str) -> str:
    """Why ``bind`` could not be bound, and the fix (an address without a scheme is the commonest slip)."""
    if "://" not in bind:
        return f"cannot bind {bind}: the address has no scheme: write tcp://{bind} (or tcp://*:PORT for every interface)"
    return f"cannot bind {bind}: {why}; pick a free port or another interface (tcp://*:PORT binds all interfaces)"


class BindError(RuntimeError):
    """The --bind address cannot be bound; the message says why and what to try."""


class ProducerDaemon:
    """Validates the dataset and the pipeline, and binds, at construction (errors surface before any worker starts).

    Raises PipelineError (a ValueError) for a pipeline that cannot be loaded or declares something
    invalid, DatasetError for an unusable dataset, TooManyRecordsError (a ValueError) for one larger than epoch
    order 1 serves, BindError for an address that cannot be bound.
    """

    def __init__(self, config: ProducerConfig, cancel: Optional[threading.Event] = None) -> None:
        config = settled(config)  # ValueError for flags that do not combine, before anything is opened
        self.config = config
        self.pipeline_standard = (("mode", config.mode), ("image_size", config.image_size),
                                  ("fast_dct", config.fast_dct))
        # Built here to fail fast (and for the layout); each worker builds its own from the same reference.
        self.pipeline = load_pipeline(config.pipeline, dict(config.pipeline_args), dict(self.pipeline_standard))
        with open_dataset(config.lmdb_path, config.remote, cancel) as dataset:  # cancel: ends a wait for storage
            self.meta = dataset.meta
            block = layout_block(config.shard, config.shuffle_window, dataset.layout)
            if dataset.manifest_bytes and dataset.layout is not None:
                # its workers read the manifest the daemon read, not a newer one, in compact form: 10^6 shards
                # of JSON would cost each worker ~4 s and ~800 MB to parse again
                config = replace(config, remote=replace(config.remote, manifest=dataset.layout.to_compact()))
                self.config = config
        #: closed: what a pool asks of its cache (holdings) opens no shard; one LMDB holds every record locally
        self.dataset: RecordSource = dataset
        self.seed = config.seed if config.seed is not None else secrets.randbits(31)
        self.stream = StreamKey(config.shard.index, config.shard.count, self.meta.count, self.seed,
                                splits=config.shard.auto, block=block, window=max(1, config.shuffle_window),
                                order_version=pool_order(config, self.meta.count))
        self.records = self.stream.size  # the shard's (a pool's: the dataset's)
        if self.stream.order_version == 1:  # before any epoch order is built
            check_materialisable(self.meta.count, f"dataset {config.lmdb_path}")
        elif not self.stream.splits:  # a fixed shard keeps per-record arrays over its own records (shard_epoch.py)
            self.stream.check_whole_order()
        check_shard_size(config, self.records)
        self.status = StatusFile(config.status_file)
        self._ctx = zmq.Context()
        # Exact mode: a ROUTER, so each batch goes to one trainer with credit and we know which.
        self._out = self._ctx.socket(zmq.ROUTER if config.exact else zmq.PUSH)
        self._out.setsockopt(zmq.SNDHWM, config.sndhwm)
        self._out.setsockopt(zmq.LINGER, 0)
        if config.exact:
            self._out.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._auth: Optional[RefusalLoggingAuthenticator] = None
        if config.curve is not None:
            # Only trainers whose public key is in the authorised folder get through the handshake;
            # refusals are logged with the peer's address.
            self._auth = RefusalLoggingAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(config.curve.authorized_clients_dir))
            self._out.curve_server = True
            self._out.curve_publickey = config.curve.public
            self._out.curve_secretkey = config.curve.secret
        try:
            self._out.bind(config.bind)
        except zmq.ZMQError as exc:
            self._out.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()
            self.status.close()
            raise BindError(_bind_advice(config.bind, exc.strerror)) from None
        self.endpoint = self._out.getsockopt(zmq.LAST_ENDPOINT).decode()
        # Made here, before the forwarding thread owns the socket; drained by run()'s loop.
        self.handshakes = HandshakeFailureLog(self._out, self.endpoint, curve=config.curve is not None)
        self.producer_id = config.producer_id or default_producer_id(self.endpoint, config.shard)
        self.stats = StageStats(config.workers, mp.get_context("spawn"))
        self.layout = SlotLayout(self.pipeline.batch_arrays(exact=config.exact), config.batch_size,
                                 slots=config.sndhwm + 1)

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; then stop everything and return. Never returns early on bad data."""
        cfg = self.config
        spawn = mp.get_context("spawn")
        ipc_dir, internal = _control_endpoint()
        control = self._ctx.socket(zmq.ROUTER)
        control.setsockopt(zmq.ROUTER_MANDATORY, 1)
        control.setsockopt(zmq.LINGER, 0)
        control.bind(internal)
        buffers = allocate(self.layout, cfg.workers, spawn)
        policy = self._policy()
        forwarder = policy.forwarder(control, self._out, self.layout, buffers)
        forwarding_stop = threading.Event()
        sender = threading.Thread(target=forwarder.run, args=(forwarding_stop,), name="stoker-forwarder", daemon=True)
        sender.start()
        worker_stop = spawn.Event()
        worker_cfg = self._worker_config(internal)
        progress = WorkerProgress(cfg.workers, MAX_SKIPPED_RECORDS, spawn)

        def start(w: int) -> mp.process.BaseProcess:
            # Fresh per process, so a dead worker's late messages are recognised (ids must not start with 0).
            routing_id = b"w" + secrets.token_bytes(8)
            forwarder.register_worker(w, routing_id)
            p = spawn.Process(target=run_worker, name=f"stoker-worker-{w}", daemon=True,
                              args=(w, worker_cfg, self.stats, worker_stop, os.getpid(), buffers[w], routing_id,
                                    progress))
            p.start()
            return p

        workers = WorkerSupervisor(start, cfg.workers, progress)
        metrics = self._start_metrics(workers)
        self._announce(metrics, policy)
        try:
            self._serve(stop, policy, forwarder, sender, workers)
        finally:
            if metrics is not None:
                metrics.close()
            worker_stop.set()
            forwarding_stop.set()
            workers.join_or_kill()
            sender.join(1.0)
            self._close(control, ipc_dir)
            self._report_stopped(policy, workers)

    def _policy(self) -> ServingPolicy:
        """This run's serving policy (``policy_for``), fresh: it holds the run's trainers."""
        cfg = self.config
        spec = [(name, dtype, [cfg.batch_size, *shape]) for name, dtype, shape in self.layout.arrays]
        # The trainer hands splits by blocks of the stream's layout: the cache says its shards as those blocks.
        cache = BlockHoldings(self.dataset, self.stream.block)
        return policy_for(cfg, self.stream, self.producer_id, spec, cache, self.stats.storage_waiting)

    def _worker_config(self, internal: str) -> WorkerConfig:
        cfg = self.config
        return WorkerConfig(
            lmdb_path=str(cfg.lmdb_path), endpoint=internal, producer_id=self.producer_id, stream=str(self.stream),
            batch_size=cfg.batch_size, seed=self.seed, workers=cfg.workers, pipeline=cfg.pipeline,
            pipeline_args=cfg.pipeline_args, pipeline_standard=self.pipeline_standard, slots=self.layout.slots,
            log_level=logging.getLogger().getEffectiveLevel(), log_format=cfg.log_format,
            repeat_batches=cfg.repeat_batches, layout_arrays=self.layout.arrays, exact=cfg.exact, remote=cfg.remote,
        )

    def _start_metrics(self, workers: WorkerSupervisor) -> Optional[MetricsServer]:
        if self.config.metrics_port is None:
            return None
        collector = ProducerCollector(self.stats, self.layout.slot_bytes, self.producer_id,
                                      workers.alive,
                                      handshake_failures=lambda: self.handshakes.failed,
                                      source=(source_kind(self.dataset), shown_location(str(self.config.lmdb_path))))
        metrics = MetricsServer(self.config.metrics_port, collector)
        log.info("metrics on http://0.0.0.0:%d/metrics", metrics.port)
        return metrics

    def _announce(self, metrics: Optional[MetricsServer], policy: ServingPolicy) -> None:
        """Bound, workers started: the "serving" log line for people, then the status line for programs."""
        cfg = self.config
        exact = "plain" if not cfg.exact else f"exact, {counted(cfg.epochs, 'epoch')}" if cfg.epochs else "exact, endless"
        log.info(
            "serving %s (%s) on %s: %s in shard %s of %d, pipeline %s (%s mode): batches of %d x {%s}, "
            "%s, seed %d, %s (stream %s), producer_id=%s",
            shown_location(str(cfg.lmdb_path)), source_kind(self.dataset), self.endpoint, counted(self.records, "record"), cfg.shard, self.meta.count,
            self.pipeline.name, cfg.mode, cfg.batch_size, self.pipeline.describe(), counted(cfg.workers, "worker"),
            self.seed, exact, self.stream, self.producer_id,
        )
        self.status.write("serving", endpoint=self.endpoint, producer_id=self.producer_id,
                          source=source_kind(self.dataset), location=shown_location(str(cfg.lmdb_path)),
                          mode=policy.mode, epochs=cfg.epochs,
                          shard=str(cfg.shard), records=self.records, seed=self.seed, workers=cfg.workers,
                          metrics_port=metrics.port if metrics is not None else None)

    def _serve(self, stop: threading.Event, policy: ServingPolicy, forwarder: SlotForwarder,
               sender: threading.Thread, workers: WorkerSupervisor) -> None:
        """Until ``stop`` (or a finite exact run's end): restart dead workers (WorkerCrashLoop when that cannot
        help), log rates every log_interval."""
        cfg = self.config
        last, last_t = self.stats.totals(), time.monotonic()
        while not stop.wait(min(0.5, cfg.log_interval)):
            self.handshakes.drain()
            if forwarder.finished:
                log.info("finished: %s of shard %s consumed; %s", counted(cfg.epochs, "exact epoch"), cfg.shard,
                         policy.summary())
                time.sleep(0.5)  # the forwarder's last status reaches the trainers
                self._out.setsockopt(zmq.LINGER, 1000)
                break
            if not sender.is_alive():
                raise RuntimeError("the forwarding thread stopped (see the error above); stopping the producer")
            now = time.monotonic()
            workers.check(now)
            if now - last_t >= cfg.log_interval:
                totals = self.stats.totals()
                log.info("%s", rate_report(last, totals, now - last_t).line())
                last, last_t = totals, now

    def _close(self, control: zmq.Socket, ipc_dir: Optional[str]) -> None:
        self.handshakes.close()
        for s in (control, self._out):
            s.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)

    def _report_stopped(self, policy: ServingPolicy, workers: WorkerSupervisor) -> None:
        """The "stopped:" log line and the status file's last line, with the same figures (``error``: why the
        producer gave up, ``WorkerCrashLoop``)."""
        restarts, failure = workers.policy.restarts, workers.failure
        totals = self.stats.totals()
        batches, images, skipped = (int(totals[k]) for k in ("batches", "images", "skipped"))
        trainers = policy.trainer_counts()
        log.info("stopped: %s, %s sent, %s skipped, %s%s", counted(batches, "batch", "batches"),
                 counted(images, "image"), counted(skipped, "record"), counted(restarts, "worker restart"),
                 "".join(f", {k}={v}" for k, v in trainers.items()))
        self.status.write("stopped", batches=batches, images=images, skipped=skipped, restarts=restarts,
                          **trainers, **({"error": failure} if failure else {}))
        self.status.close()
