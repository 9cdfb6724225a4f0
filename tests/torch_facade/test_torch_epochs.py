"""``TorchInput.epochs()`` under torchrun: three gloo ranks (CPU) with uneven shares of an elastic pool end every
epoch together, after equal step counts, each record trained once per epoch; the ranks' own per-step all-reduce
(DDP's, here explicit) never hangs, because a rank whose share ran out steps on padding (``mask`` False).

One small job (records not divisible among the ranks, two epochs); every wait is bounded: the producers by
``recv_timeout``, the collectives by the process group's timeout, the job by the subprocess timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

if not os.environ.get("CI"):  # CI installs the extra (.ci/run): there a missing torch fails the run
    pytest.importorskip("torch", reason="the stoker[torch] extra is not installed (.ci/run installs it)")

from stoker.producer.dataset.build.synthetic import build_synthetic
from stoker.producer.process import ProducerProcess

pytestmark = pytest.mark.timeout(300)

RECORDS = 100  # batches of 8: 13 splits, the last of 4, so three ranks hold 5, 4 and 4 of them
BATCH = 8
WORLD = 3
EPOCHS = 2

# One rank: for each epoch of inp.epochs(), a step per batch with an all-reduce of the batch's real rows (what a
# DDP step's gradient all-reduce would make every rank wait for); it logs each epoch's rows, steps and padding.
RANK = textwrap.dedent('''
    import datetime, json, os, sys
    import torch, torch.distributed as dist
    from stoker.consumer import TorchInput
    addresses, logs = sys.argv[1].split(","), sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank = dist.get_rank()
    epochs = []
    with TorchInput(addresses, exact=True, recv_timeout=60) as inp:
        # patient for ever (a pool allows it): whether a rank pads then depends on its share alone, not on timing
        for epoch, batches in inp.epochs(pad_after=float("inf")):
            rows, steps, padding, trained = [], 0, 0, torch.zeros(1)
            for batch in batches:
                steps += 1
                real = batch["mask"].sum().reshape(1).float()
                dist.all_reduce(real)  # every rank takes part in every step's collective
                trained += real
                if not batch["mask"].any():
                    padding += 1
                    continue
                rows += list(zip(batch["epoch"].tolist(), batch["index"].tolist()))
            epochs.append({"epoch": epoch, "rows": rows, "steps": steps, "padding": padding,
                           "trained": int(trained.item()), "job": inp.job_consumed_epochs})
    with open(f"{logs}/rank{rank}.json", "w") as out:
        json.dump(epochs, out)
    dist.barrier()
    os._exit(0)  # no gloo teardown at exit: it can deadlock in PyTorch (see examples/torch_ddp.py)
''')


@pytest.fixture(scope="module")
def lmdb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("torch-epochs") / "ds"
    build_synthetic(path, RECORDS, seed=3, num_classes=4, progress=False)
    return path


def test_three_torchrun_ranks_with_uneven_shares_end_each_epoch_together_with_each_record_once(lmdb, tmp_path):
    args = ["--workers", "1", "--batch-size", str(BATCH), "--image-size", "16", "--seed", "5",
            "--epochs", str(EPOCHS), "--shard", "auto"]
    producers = [ProducerProcess(lmdb, extra_args=args) for _ in range(2)]
    logs = tmp_path / "logs"
    logs.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
               str(script), ",".join(p.endpoint for p in producers), str(logs)]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    finally:
        for producer in producers:
            producer.stop()
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    ranks = [json.loads((logs / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert all([e["epoch"] for e in rank] == list(range(EPOCHS)) for rank in ranks), ranks
    for epoch in range(EPOCHS):
        mine = [rank[epoch] for rank in ranks]
        assert len({e["steps"] for e in mine}) == 1, [e["steps"] for e in mine]  # equal steps on every rank
        assert {e["job"] for e in mine} == {epoch + 1}  # the job consumed this epoch, as every rank agreed
        assert {e["trained"] for e in mine} == {RECORDS}  # the per-step all-reduce: every record, no padding row
        rows = [row for e in mine for row in e["rows"]]
        counts = Counter(index for _, index in rows)
        assert {e for e, _ in rows} == {epoch}
        assert sorted(counts) == list(range(RECORDS)) and set(counts.values()) == {1}
        assert all(e["rows"] for e in mine)  # each rank trained its own share
        assert min(e["padding"] for e in mine) == 0  # the rank with the most batches never pads
