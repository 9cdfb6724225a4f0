"""``stoker train --local-producer N``: the flags make the ``LocalProducer`` the input starts, or a usage error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stoker.cli.main import build_parser
from stoker.cli.train.local_producer_flags import local_producer_of


def _args(*flags: str):
    return build_parser().parse_args(["train", *flags])


def test_the_flags_make_the_local_producer_with_the_remote_producers_flags():
    local = local_producer_of(_args("--local-producer", "3", "--local-producer-data", "/data/index.json",
                                    "--local-producer-flags", "--pipeline imagenet --batch-size 64 --shard auto "
                                    "--seed 0", "--local-producer-cpus", "0-1", "--exact"))
    assert (local.data, local.workers, local.cpus, local.nice) == ("/data/index.json", 3, (0, 1), 10)
    assert local.extra_flags == ("--pipeline", "imagenet", "--batch-size", "64", "--shard", "auto", "--seed", "0")
    assert local_producer_of(_args("--connect", "tcp://h:1")) is None


@pytest.mark.parametrize("flags, error", [
    (["--local-producer", "2"], "--local-producer-data"),
    (["--local-producer-data", "/d"], "add --local-producer WORKERS"),
    (["--local-producer", "1", "--local-producer-data", "/d", "--local-producer-flags", "--bind tcp://*:1"],
     "set by the launcher"),
    (["--local-producer", "1", "--local-producer-data", "/d", "--exact"], "plain producer"),
])
def test_local_producer_flags_that_cannot_work_are_named(flags, error):
    with pytest.raises(ValueError, match=error):
        local_producer_of(_args(*flags))


def test_train_without_connect_or_a_local_producer_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "train", "--local-producer-cpus", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "add --local-producer WORKERS" in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "train"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--connect: give at least one producer address" in out.stderr, out.stderr
