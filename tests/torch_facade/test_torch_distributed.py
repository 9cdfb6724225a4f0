"""TorchInput under torchrun: real ranks in a gloo process group (CPU), each with its own input on the same
exact producers, together consume each record exactly once per epoch; a checkpoint taken with
``torch.distributed.checkpoint`` by every rank resumes the epoch on a fresh job of the same world."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

if not os.environ.get("CI"):  # CI installs the extra (.ci/run): there a missing torch fails the run
    pytest.importorskip("torch", reason="the stoker[torch] extra is not installed (.ci/run installs it)")

from stoker.producer.process import ProducerProcess
from stoker.producer.dataset.build.synthetic import build_synthetic

from conftest import assert_exactly_once

pytestmark = pytest.mark.timeout(300)

RECORDS = 96  # batches of 8: 12 splits of one batch in an elastic pool, 6 for each of two ranks
BATCH = 8
WORLD = 2

# One rank of a torchrun job: its TorchInput takes (rank, world) from the process group; it trains until the
# producers' finite run ends (or for `steps`), then, with `ckpt`, saves or loads its input with DCP under its
# own key, and writes the (epoch, index) rows it consumed and the all-reduced total to its log. `sync`: the
# ranks wait for each other after their first batch, as a DDP step's all-reduce makes them do. A finite elastic
# pool needs that: a producer finishes once a trainer finished its whole run and every trainer it knows did too,
# so a rank that said no hello before another rank's whole share was consumed would find the run over.
RANK = textwrap.dedent('''
    import json, os, sys
    import torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from stoker.consumer import TorchInput
    from stoker.consumer.torch.torch_input import default_share
    addresses, logs, steps, (ckpt, load, sync) = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3]), sys.argv[4:7]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert default_share(None, exact=False) == (0, 1)  # plain mode needs no share: PUSH splits the batches
    rows = []
    with TorchInput(addresses, exact=True, recv_timeout=60, queue_capacity=4) as inp:
        assert inp.share == (rank, world), inp.share
        key = f"input_rank{rank}"  # each rank's state under its own key: DCP keeps one copy of a shared key
        if load == "load":
            dcp.load({key: inp}, checkpoint_id=ckpt)
        for step, batch in enumerate(inp):
            rows += list(zip(batch["epoch"].tolist(), batch["index"].tolist()))
            if step == 0 and sync == "sync":
                dist.barrier()
            if step + 1 == steps:
                break
        if load == "save":
            dcp.save({key: inp}, checkpoint_id=ckpt)
        trainer_id = inp.trainer_id
    total = torch.tensor([len(rows)])
    dist.all_reduce(total)
    with open(f"{logs}/rank{rank}.json", "w") as out:
        json.dump({"rows": rows, "total": int(total), "trainer_id": trainer_id}, out)
    dist.barrier()
    os._exit(0)  # no gloo teardown at exit: it can deadlock in PyTorch (see examples/torch_ddp.py)
''')


@pytest.fixture(scope="module")
def lmdb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ddp") / "ds"
    build_synthetic(path, RECORDS, seed=3, num_classes=4, progress=False)
    return path


def _torchrun(tmp_path: Path, addresses: list[str], logs: Path, steps: int = 0, ckpt: str = "", load: str = "no",
              sync: bool = True) -> list[dict]:
    """Run a torchrun job of WORLD ranks to its end; each rank's log."""
    logs.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
               str(script), ",".join(addresses), str(logs),
               str(steps), ckpt or str(tmp_path / "unused"), load, "sync" if sync else "free"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    return [json.loads((logs / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("pool", ["elastic", "fixed"])
def test_two_torchrun_ranks_take_their_share_from_the_process_group_and_consume_each_record_once(
        lmdb, tmp_path, pool):
    common = ["--workers", "1", "--batch-size", str(BATCH), "--image-size", "16", "--seed", "5", "--epochs", "1"]
    # Fixed shards: --min-trainers holds the run until both ranks joined (a rank may still get no batch: no sync).
    shards = [["--shard", "auto"]] * 2 if pool == "elastic" else [["--shard", f"{i}/2", "--min-trainers", "2"]
                                                                   for i in range(2)]
    producers = [ProducerProcess(lmdb, extra_args=[*common, *shard]) for shard in shards]
    try:
        ranks = _torchrun(tmp_path, [p.endpoint for p in producers], tmp_path / "logs", sync=pool == "elastic")
    finally:
        for producer in producers:
            producer.stop()
    assert_exactly_once(ranks[0]["rows"] + ranks[1]["rows"], set(range(RECORDS)))
    assert ranks[0]["total"] == ranks[1]["total"] == RECORDS  # the gloo all_reduce of what each rank consumed
    if pool == "elastic":  # each rank's own splits: both train, neither on the other's records
        assert ranks[0]["rows"] and ranks[1]["rows"]


def test_a_job_checkpointed_with_dcp_on_every_rank_resumes_its_epoch_with_each_record_once(lmdb, tmp_path):
    args = ["--workers", "1", "--batch-size", str(BATCH), "--image-size", "16", "--seed", "5", "--epochs", "1",
            "--shard", "auto", "--trainer-timeout", "5"]
    producers = [ProducerProcess(lmdb, extra_args=args) for _ in range(2)]
    ckpt = str(tmp_path / "ckpt")
    try:
        addresses = [p.endpoint for p in producers]
        first = _torchrun(tmp_path, addresses, tmp_path / "first", steps=2, ckpt=ckpt, load="save")
        second = _torchrun(tmp_path, addresses, tmp_path / "second", ckpt=ckpt, load="load")
    finally:
        for producer in producers:
            producer.stop()
    assert [r["trainer_id"] for r in second] == [r["trainer_id"] for r in first]  # each rank its own state back
    assert len({r["trainer_id"] for r in first}) == WORLD
    assert_exactly_once([row for job in (first, second) for rank in job for row in rank["rows"]],
                        set(range(RECORDS)))
