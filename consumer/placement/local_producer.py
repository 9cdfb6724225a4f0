"""A producer on the trainer's own host, over ``ipc://`` (Pecan's AutoPlacement: the host's spare cores first).

``LocalProducer`` says how to start it: the same ``stoker produce`` dataset and flags the remote producers run
with, plus how many workers, on which cores (``cpus``) and how much lower in priority than the training step
(``nice``). A facade given ``local_producer=`` starts it before it connects (``LocalProducer.start`` ->
``LocalProducerProcess``), reads its ``ipc://`` address besides the remote ones, and stops it at ``close()``.
It is one more producer of the pool: its batches, its capacity in the pool's sizing, its id (``local-HOST-PID-X``)
in the stats, like any producer.

The running child, its launcher (nice, pin), its stop and its death watch are ``local_process.py``'s. Imports
nothing of Stoker's: the producer is a command line, never imported.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from stoker.consumer.sizing.supply import LOCAL_PRODUCER_PREFIX

if TYPE_CHECKING:
    from stoker.consumer.placement.local_process import LocalProducerProcess

#: the producer id's prefix, so stats and metrics show which producer ran on the trainer's host, and the pool-size
#: estimate counts it apart (the pool adds remote producers): one prefix, owned by consumer/sizing
LOCAL_PREFIX = LOCAL_PRODUCER_PREFIX
#: ``stoker produce`` flags the local producer's launcher sets itself (``extra_flags`` must leave them out)
OWNED_FLAGS = ("--data", "--lmdb", "--bind", "--id", "--parent-pid", "--status-file", "--workers")
#: CPU numbers a CPU list may name (Linux's CONFIG_NR_CPUS is at most 8192): a range is bounded before it is made
MAX_CPU = 8191


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"1,2"`` or ``"1-3"`` (or both, ``"0,2-3"``) -> the CPU numbers; ValueError naming the form expected."""
    cpus: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",")):
            first, _, last = part.partition("-")
            low, high = int(first), int(last or first)
            if not 0 <= low <= high <= MAX_CPU:
                raise ValueError(part)
            cpus += range(low, high + 1)
    except ValueError:
        raise ValueError(f"CPU list {text!r}: write CPU numbers 0-{MAX_CPU} like 1,2 or ranges like 1-3") from None
    return tuple(sorted(set(cpus)))


@dataclass(frozen=True)
class LocalProducer:
    """How to start a producer on the trainer's host; ``start()`` starts it (a facade does, given
    ``local_producer=``).

    ``data``: the dataset location the remote producers serve (``stoker produce --data``: a path, URL or
    ``.json`` index). ``workers``: its decode processes (default 1). ``pipeline``: ``--pipeline`` (None: the
    producer's default, imagenet, or a ``--pipeline`` in ``extra_flags``). ``extra_flags``: the other ``stoker
    produce`` flags the remote producers run with (``--batch-size``, ``--image-size``, ``--seed``, ``--shard
    auto``, ``--exact``, ...; not those in ``OWNED_FLAGS``). ``cpus``: the cores it may use (None: any), e.g. those the training step leaves idle.
    ``nice``: how much lower its priority is than the trainer's (default 10; 0-19). ``start_timeout``: seconds
    it may take to bind (60); ``stop_timeout``: seconds SIGTERM may take before SIGKILL (5). ValueError naming
    the fix for a bad value."""

    data: str
    workers: int = 1
    pipeline: Optional[str] = None
    extra_flags: Sequence[str] = ()
    cpus: Optional[Sequence[int]] = None
    nice: int = 10
    start_timeout: float = 60.0
    stop_timeout: float = 5.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", os.fspath(self.data))
        object.__setattr__(self, "extra_flags", tuple(self.extra_flags))
        if self.cpus is not None:
            object.__setattr__(self, "cpus", tuple(sorted(set(int(c) for c in self.cpus))))
        if not self.data:
            raise ValueError("local_producer data: give the dataset location the remote producers serve (--data)")
        if self.workers < 1:
            raise ValueError(f"local_producer workers={self.workers}: give processes >= 1")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"local_producer nice={self.nice}: give 0-19 (default 10: below the training step)")
        if not self.start_timeout > 0 or not self.stop_timeout > 0:
            raise ValueError("local_producer start_timeout and stop_timeout: give seconds > 0")
        cores = os.cpu_count() or 1
        if self.cpus is not None and (not self.cpus or not all(0 <= c < cores for c in self.cpus)):
            raise ValueError(f"local_producer cpus={list(self.cpus)}: give CPU numbers 0-{cores - 1} of this host")
        for flag in self.extra_flags:
            if not isinstance(flag, str):
                raise ValueError(f"local_producer extra_flags: {flag!r} is not a string (give argv words)")
            if flag.split("=", 1)[0] in OWNED_FLAGS:
                raise ValueError(f"local_producer extra_flags: {flag} is set by the launcher; give it as a field "
                                 "(data, workers) or leave it out (bind, id, parent pid, status file)")
            if self.pipeline is not None and flag.split("=", 1)[0] == "--pipeline":
                raise ValueError("local_producer: give the pipeline once, as pipeline= or as --pipeline in extra_flags")

    @property
    def exact(self) -> bool:
        """Whether its flags start an exact-mode producer (``--exact``, ``--epochs N``, ``--shard auto``)."""
        words = list(self.extra_flags)
        return any(word == "--exact" or word.split("=", 1)[0] == "--epochs" or word == "--shard=auto"
                   or (word, after) == ("--shard", "auto") for word, after in zip(words, [*words[1:], ""]))

    def check_mode(self, exact: bool) -> None:
        """ValueError unless its flags run the input's mode (an exact input needs an exact producer, and back)."""
        if exact and not self.exact:
            raise ValueError("exact=True, but local_producer's extra_flags start a plain producer: add the remote "
                             "producers' mode flags (--exact, --epochs N or --shard auto, with their --seed)")
        if self.exact and not exact:
            raise ValueError("local_producer's extra_flags start an exact-mode producer, but the input is plain: "
                             "pass exact=True (--exact), or leave --exact/--epochs/--shard auto out of them")

    def command(self, bind: str, producer_id: str, parent_pid: int) -> list[str]:
        """The producer's argv (``stoker produce``), without the launcher that nices and pins it."""
        pipeline = ["--pipeline", self.pipeline] if self.pipeline is not None else []
        return [sys.executable, "-m", "stoker.cli.main", "produce", "--data", self.data, "--bind", bind,
                "--workers", str(self.workers), *pipeline, "--id", producer_id, "--parent-pid", str(parent_pid),
                *self.extra_flags]

    def start(self) -> "LocalProducerProcess":
        """Start it and wait until it bound its socket (up to ``start_timeout``); LocalProducerError otherwise."""
        from stoker.consumer.placement.local_process import LocalProducerProcess

        return LocalProducerProcess(self)
