"""`stoker cluster`: producers in their own network namespaces feed a trainer in another, then all is gone."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from stoker.cli.cluster.local_cluster import ClusterError, check_available

pytestmark = pytest.mark.timeout(300)


def _harness_missing() -> str:
    try:
        check_available()
    except ClusterError as exc:
        return str(exc)
    return ""


def _assert_its_namespaces_are_gone(stdout: str) -> None:
    """The namespaces that run made (named in its output, ``stk<tag>-...``) are gone; others are not its
    business (an earlier killed run's, or a concurrent run's, which come and go meanwhile)."""
    tags = set(re.findall(r"namespace (stk[0-9a-f]+)-", stdout))
    assert tags, stdout[-2000:]
    left = {ns for ns in _our_namespaces() if ns.split("-")[0] in tags}
    assert not left, f"namespaces left behind: {sorted(left)}"


# A trainer's summary: one line per producer it received from; the harness's: one per producer it ran.
_RECEIVED_RE = re.compile(r"^(?:trainer\d+: )?  (\S+): ([\d,]+) batches, [\d,]+ images, \d+ images/s$", re.M)
_SERVED_RE = re.compile(r"^  (\S+): ([\d,]+) batches, [\d,]+ images, (?:\d+ images/s over [\d.]+ s|not timed.*)$", re.M)


def _per_producer(pattern: re.Pattern, stdout: str) -> dict[str, int]:
    return {name: int(n.replace(",", "")) for name, n in pattern.findall(stdout)}


def _our_namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("stk")}


@pytest.mark.skipif(bool(_harness_missing()), reason=_harness_missing() or "harness available")
def test_stoker_cluster_trains_from_producers_on_separate_hosts_and_tears_down(synth_lmdb):
    result = subprocess.run(
        [sys.executable, "-m", "stoker.cli.main", "cluster", "--lmdb", str(synth_lmdb), "--hosts", "2",
         "--rate", "1gbit", "--batch-size", "8", "--image-size", "32", "--steps", "30", "--queue-capacity", "4",
         "--no-progress"],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # Each producer served from its own host address, and the trainer received from both.
    assert "producer on tcp://10.213.0.101:5555" in result.stdout and "producer on tcp://10.213.0.102:5555" in result.stdout
    assert re.search(r"batches received: [\d,]+, rejected: 0; per producer", result.stdout), result.stdout[-2000:]
    received = _per_producer(_RECEIVED_RE, result.stdout)
    assert sorted(received) == ["data0#0/2", "data1#1/2"], result.stdout[-2000:]
    assert all(n > 0 for n in received.values()), received
    # The harness's own line per producer: what each daemon counted at its stop.
    assert "producers (each daemon's own count at its stop" in result.stdout, result.stdout[-2000:]
    served = _per_producer(_SERVED_RE, result.stdout)
    assert sorted(served) == ["data0#0/2", "data1#1/2"], result.stdout[-2000:]
    assert all(served[name] >= received[name] for name in served), (served, received)
    assert "trained 30 steps" in result.stdout
    _assert_its_namespaces_are_gone(result.stdout)


@pytest.mark.skipif(bool(_harness_missing()), reason=_harness_missing() or "harness available")
def test_two_trainer_hosts_and_two_producer_hosts_train_and_cover_the_epoch_exactly_once(synth_lmdb, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "stoker.cli.main", "cluster", "--lmdb", str(synth_lmdb), "--hosts", "2",
         "--trainers", "2", "--epochs", "1", "--mode", "eval", "--batch-size", "4", "--image-size", "32",
         "--steps", "1000", "--queue-capacity", "2", "--log-consumed", str(tmp_path / "consumed")],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for name in ("trainer0", "trainer1"):
        assert f"{name}: trained " in result.stdout, f"{name} did not train:\n{result.stdout[-3000:]}"
        lines = re.findall(rf"^{name}:   (\S+): [\d,]+ batches, [\d,]+ images, \d+ images/s$", result.stdout, re.M)
        assert lines and set(lines) <= {"data0#0/2", "data1#1/2"}, result.stdout[-3000:]
    assert sorted(_per_producer(_SERVED_RE, result.stdout)) == ["data0#0/2", "data1#1/2"], result.stdout[-3000:]
    seen: dict[int, int] = {}
    for name in ("trainer0", "trainer1"):
        lines = (tmp_path / "consumed" / f"{name}.jsonl").read_text().splitlines()
        assert lines, f"{name} consumed nothing"
        for line in lines:
            step = json.loads(line)
            assert set(step["epoch"]) == {0}
            for index in step["index"]:
                seen[index] = seen.get(index, 0) + 1
    assert sorted(seen) == list(range(96)) and set(seen.values()) == {1}, "coverage across trainers is not exact"
    _assert_its_namespaces_are_gone(result.stdout)


def test_stoker_cluster_without_root_says_what_it_needs(synth_lmdb, tmp_path):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root to drop privileges with setpriv")
    result = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "stoker.cli.main",
         "cluster", "--lmdb", str(synth_lmdb), "--hosts", "1", "--steps", "1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)})
    assert result.returncode == 2 and "needs root" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_an_unreadable_lmdb_is_a_clear_error_not_a_traceback(synth_lmdb, tmp_path):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root to drop privileges with setpriv")
    result = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "stoker.cli.main",
         "lmdb", "info", str(synth_lmdb)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path)})
    assert result.returncode == 2 and "Permission denied" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(bool(_harness_missing()), reason=_harness_missing() or "harness available")
def test_an_elastic_pool_gains_and_loses_a_data_host_mid_run_and_every_epoch_stays_exact(synth_lmdb):
    # At 0 s: as soon as the trainers consume, one host joins and the first leaves; the run then ends by itself.
    result = subprocess.run(
        [sys.executable, "-m", "stoker.cli.main", "cluster", "--lmdb", str(synth_lmdb), "--hosts", "2",
         "--trainers", "2", "--epochs", "2", "--batch-size", "4", "--image-size", "32", "--steps", "1000",
         "--queue-capacity", "2", "--add-host-at", "0", "--remove-host-at", "0"],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "data2 joined the pool (3 hosts)" in result.stdout and "data0 left the pool (2 hosts)" in result.stdout
    for name in ("trainer0", "trainer1"):
        assert f"{name}: trained " in result.stdout, f"{name} did not train:\n{result.stdout[-3000:]}"
    # Every epoch's coverage on one line: both complete, every record once.
    assert "  epochs 0-1 (2 epochs): 96/96 records each (100.0%), none seen more than once\n" in result.stdout, \
        result.stdout[-3000:]
    assert "epoch 2" not in result.stdout
    # One line per producer of the pool, the one that joined and the one that left included (whatever each sent).
    assert sorted(_per_producer(_SERVED_RE, result.stdout)) == ["data0#auto", "data1#auto", "data2#auto"], \
        result.stdout[-3000:]
    _assert_its_namespaces_are_gone(result.stdout)


def test_coverage_is_one_line_for_the_epochs_consumed_exactly_once_and_one_for_each_other(tmp_path):
    """A long run on a small dataset has many epochs: those every record of which came once share one line; an
    epoch cut short or with a record twice is named on its own."""
    from stoker.cli.cluster.elastic import ConsumedWatcher

    def write(path, steps):
        path.write_text("".join(json.dumps({"step": n, "epoch": [e] * len(ix), "index": ix}) + "\n"
                                for n, (e, ix) in enumerate(steps)))

    write(tmp_path / "trainer0.jsonl", [(e, [0, 1]) for e in range(60)])
    write(tmp_path / "trainer1.jsonl", [(e, [2, 3] if e != 57 else [2]) for e in range(60)] + [(58, [0])])
    watcher = ConsumedWatcher([tmp_path / "trainer0.jsonl", tmp_path / "trainer1.jsonl"])
    assert watcher.poll() == 60 * 4 - 1 + 1
    assert watcher.coverage(4) == [
        "epochs 0-56, 59 (58 epochs): 4/4 records each (100.0%), none seen more than once",
        "epoch 57: 3/4 records (75.0%), 0 seen more than once",
        "epoch 58: 4/4 records (100.0%), 1 seen more than once",
    ]
    single = ConsumedWatcher([tmp_path / "trainer0.jsonl"])
    single.poll()
    assert single.coverage(2)[:1] == ["epochs 0-59 (60 epochs): 2/2 records each (100.0%), none seen more than once"]
    assert ConsumedWatcher([tmp_path / "none.jsonl"]).coverage(4) == ["no records consumed"]
