"""The benchmark harness: what the scripts in benchmarks/ do around their measurements.

- Arguments and results: ``benchmark_parser`` (the script's docstring as its ``--help``),
  ``add_out_argument`` (``--out``, default ``benchmarks/results/NAME``), ``machine_info``
  (the keys every result carries about the machine) and ``write_results`` (the JSON file, then
  ``wrote PATH``).
- CPU accounting: ``own_cpu_seconds`` (this process), ``cpu_now`` / ``producers_cpu_now``
  (this process, producer daemons and their workers at once, from getrusage and /proc) and
  ``CpuSeconds``, whose difference is what each part used in between.
- Data and producers: ``synthetic_lmdb`` (a temporary synthetic dataset), ``producer_flags``,
  ``launch_producer`` and ``launch_sharded`` (``ProducerProcess`` daemons with the usual flags).
- Timing: ``mean_step_seconds`` (a training step's mean time after warm-up).

Scripts run as ``python benchmarks/X.py``, so Python puts this folder first on ``sys.path`` and
``from harness import ...`` needs no path edits. A file the producer loads with ``--pipeline
benchmarks/X.py:make_pipeline`` is imported without this folder on the path: such a file imports
from here inside its functions only (see ``user_pipeline_scaling.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from stoker.producer.measure.procfs import cpu_seconds
from stoker.consumer.train import throughput
from stoker.producer.process import ProducerProcess
from stoker.producer.produce_command import produce_flags

RESULTS = Path(__file__).parent / "results"


# ---- arguments and results ---------------------------------------------------------------------

def benchmark_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose ``--help`` shows the script's docstring as written (line breaks kept)."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_out_argument(parser: argparse.ArgumentParser, name: str) -> None:
    """``--out``: where the results JSON goes, by default ``benchmarks/results/<name>``."""
    parser.add_argument("--out", default=str(RESULTS / name))


def machine_info() -> dict[str, Any]:
    """What a result says about the machine it was measured on: ``cpus``, ``machine``, ``python``."""
    return {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()}


def write_json(path: str | os.PathLike, data: Any, end: str = "") -> Path:
    """``data`` as indented JSON at ``path`` (its folder made if missing), followed by ``end``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + end)
    return out


def write_results(path: str | os.PathLike, result: Any) -> None:
    """Write a benchmark's results JSON and say where it went (``wrote PATH``), the last line a script prints."""
    write_json(path, result)
    print(f"wrote {path}")


# ---- CPU accounting ----------------------------------------------------------------------------

def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all its threads (getrusage)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pid_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc); 0.0 once it is gone."""
    try:
        return cpu_seconds(pid)
    except OSError:
        return 0.0


@dataclass(frozen=True)
class CpuSeconds:
    """CPU seconds (user + system) of this process (``own``), producer daemons and their workers.

    A reading is cumulative; ``after - before`` is what each part used in between."""

    own: float = 0.0
    daemons: float = 0.0
    workers: float = 0.0

    @property
    def producers(self) -> float:
        """Daemons and workers together: what the producers used."""
        return self.daemons + self.workers

    def __sub__(self, other: CpuSeconds) -> CpuSeconds:
        return CpuSeconds(self.own - other.own, self.daemons - other.daemons, self.workers - other.workers)


def cpu_now(daemons: Iterable[int] = (), workers: Iterable[int] = ()) -> CpuSeconds:
    """This process's CPU seconds and the sums over the ``daemons`` and ``workers`` pids, read now.

    Pass worker pids read once (``producer.child_pids()``) to keep the /proc scan out of a timed window."""
    return CpuSeconds(own_cpu_seconds(), sum(pid_cpu_seconds(p) for p in daemons),
                      sum(pid_cpu_seconds(p) for p in workers))


def producers_cpu_now(producers: Iterable[ProducerProcess]) -> CpuSeconds:
    """``cpu_now`` for these producers' daemons and their workers as they are now (scans /proc for them)."""
    producers = list(producers)
    return cpu_now([p.pid for p in producers], [c for p in producers for c in p.child_pids()])


# ---- data and producers ------------------------------------------------------------------------

@contextmanager
def synthetic_lmdb(records: int, name: str = "bench") -> Iterator[Path]:
    """A synthetic LMDB of ``records`` JPEGs (seed 0) in a temporary folder, removed on exit; yields its path.

    The folder (``path.parent``) is the caller's to put other temporary files in."""
    from stoker.producer.dataset.build.synthetic import build_synthetic

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        build_synthetic(path, records, seed=0, progress=False)
        yield path


def producer_flags(batch_size: int, image_size: int | None = None, workers: int = 1, seed: int | None = None,
                   repeat_batches: bool = False, **more: Any) -> list[str]:
    """``stoker produce`` flags the benchmarks share: ``--workers``, ``--batch-size``, then where given
    ``--image-size``, ``--repeat-batches 2`` (pre-made batches: decoding out of the way) and ``--seed``.
    No ``--seed`` by default: the daemon then picks its own, as it does for users. Built by
    ``stoker.producer.produce_command.produce_flags``, the one place produce command lines are made; ``more`` goes
    to it (``shard``, ``producer_id``, ``epochs``, ``exact``, ``trainer_timeout``, ...)."""
    return produce_flags(workers=workers, batch_size=batch_size, image_size=image_size,
                         repeat_batches=2 if repeat_batches else None, seed=seed, **more)


def run_stoker(*argv: str, env: dict | None = None, timeout: float = 600) -> None:
    """``stoker ARGV...`` by this interpreter (``lmdb synth``, ``lmdb upload``, ...); RuntimeError with its stderr's
    tail if it fails."""
    done = subprocess.run([sys.executable, "-m", "stoker.cli.main", *argv], capture_output=True, text=True,
                          env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"stoker {' '.join(argv)} failed: {done.stderr[-2000:]}")


def launch_producer(lmdb: str | os.PathLike, flags: Sequence[str], **process_args: Any) -> ProducerProcess:
    """A producer daemon serving ``lmdb`` with ``flags`` (see ``producer_flags``), started and serving.

    ``process_args`` go to ``ProducerProcess`` (``bind``, ``start_timeout``, ``command_prefix``, ...).
    The caller stops it: ``with launch_producer(...) as producer:``."""
    return ProducerProcess(lmdb, extra_args=list(flags), **process_args)


def launch_sharded(stack: ExitStack, lmdb: str | os.PathLike, count: int, flags: Sequence[str],
                   parallel: bool = False, **process_args: Any) -> list[ProducerProcess]:
    """``count`` producers serving shards ``0/count`` ... of ``lmdb``, each stopped when ``stack`` closes.

    ``parallel``: start them all at once (threads), for many producers; otherwise one after the other."""

    def launch(i: int) -> ProducerProcess:
        return launch_producer(lmdb, [*flags, "--shard", f"{i}/{count}"], **process_args)

    if not parallel:
        return [stack.enter_context(launch(i)) for i in range(count)]
    with ThreadPoolExecutor(count) as pool:
        producers = list(pool.map(launch, range(count)))
    for p in producers:
        stack.enter_context(p)
    return producers


# ---- timing ------------------------------------------------------------------------------------

#: a training step's mean seconds after warm-up: the same measure as ``stoker train``'s throughput sweep
mean_step_seconds = throughput.mean_step_seconds
