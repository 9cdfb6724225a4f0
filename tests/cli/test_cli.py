"""Every command explains itself."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from stoker.producer.process import ProducerProcess

COMMANDS = [[], ["lmdb"], ["lmdb", "build"], ["lmdb", "synth"], ["lmdb", "info"], ["produce"], ["train"], ["demo"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "stoker")
def test_help_explains_every_option_with_its_default(command):
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", *command, "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage: stoker" in out.stdout
    if command in (["produce"], ["train"], ["demo"], ["lmdb", "synth"]):
        assert "(default:" in out.stdout


def test_produce_help_documents_the_batch_format():
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "produce", "--help"],
                         capture_output=True, text=True, timeout=60)
    for flag in ("--data", "--lmdb", "--bind", "--workers", "--batch-size", "--image-size", "--mode", "--shard", "--seed"):
        assert flag in out.stdout
    assert "uint8 [B,H,W,3]" in out.stdout


def test_produce_reads_its_dataset_from_data_and_from_the_old_lmdb_alike():
    from stoker.cli.main import build_parser

    parse = build_parser().parse_args
    new, old = parse(["produce", "--data", "/d/index.json"]), parse(["produce", "--lmdb", "/d/index.json"])
    assert new.lmdb == old.lmdb == "/d/index.json" and vars(new) == vars(old)


@pytest.mark.parametrize("command, message", [
    (["train", "--connect", "tcp://127.0.0.1:1", "--report", "/nonexistent-folder/run.html"],
     "folder /nonexistent-folder does not exist"),
    (["train", "--connect", "tcp://127.0.0.1:1", "--log-consumed", "/nonexistent-folder/steps.jsonl"],
     "folder /nonexistent-folder does not exist"),
    (["train", "--connect", "tcp://127.0.0.1:1", "--exact", "--trainer-id", "rank 0"], "printable ASCII"),
    (["doctor", "--connect", "tcp://127.0.0.1:1", "--report", "/nonexistent-folder/doctor.html"],
     "folder /nonexistent-folder does not exist"),
])
def test_outputs_written_at_the_end_of_a_run_are_checked_before_it_starts(command, message):
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", *command], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_an_address_without_a_scheme_is_named_with_its_fix_in_train_and_produce(synth_lmdb):
    # Issue 31.3: `--connect 127.0.0.1:5555` used to say "needs at least one producer address", and
    # `--bind 127.0.0.1:5560` "pick a free port or another interface".
    train = subprocess.run([sys.executable, "-m", "stoker.cli.main", "train", "--connect", "127.0.0.1:5555"],
                           capture_output=True, text=True, timeout=60)
    assert train.returncode == 2 and "write tcp://127.0.0.1:5555" in train.stderr, train.stderr
    produce = subprocess.run([sys.executable, "-m", "stoker.cli.main", "produce", "--lmdb", str(synth_lmdb),
                              "--bind", "127.0.0.1:5560"], capture_output=True, text=True, timeout=60)
    assert produce.returncode == 2 and "write tcp://127.0.0.1:5560" in produce.stderr, produce.stderr
    assert "Traceback" not in train.stderr + produce.stderr


@pytest.mark.parametrize("command, usage, hint", [
    (["produce", "--batchsize", "16"], "usage: stoker produce", "--batchsize: did you mean --batch-size?"),
    (["train", "--conect", "tcp://127.0.0.1:1"], "usage: stoker train", "--conect: did you mean --connect?"),
])
def test_a_flag_typo_gets_the_subcommands_usage_and_the_close_match(command, usage, hint):
    # Issue 31.9: the top-level usage (produce) or only "--connect is required" (train) used to be all.
    out = subprocess.run([sys.executable, "-m", "stoker.cli.main", *command], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and usage in out.stderr and hint in out.stderr, out.stderr
    assert f"see `stoker {command[0]} --help`" in out.stderr


@pytest.mark.timeout(300)
def test_train_summary_has_a_line_per_producer_with_its_batches_images_and_images_per_s(synth_lmdb):
    args = ["--workers", "1", "--batch-size", "8", "--image-size", "32"]
    with ProducerProcess(synth_lmdb, extra_args=[*args, "--shard", "0/2"]) as p0, \
            ProducerProcess(synth_lmdb, extra_args=[*args, "--shard", "1/2"]) as p1:
        out = subprocess.run([sys.executable, "-m", "stoker.cli.main", "train", "--connect",
                              f"{p0.endpoint},{p1.endpoint}", "--steps", "30", "--batch-size", "8", "--image-size",
                              "32", "--classes", "4", "--queue-capacity", "4", "--no-progress"],
                             capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^batches received: [\d,]+, rejected: 0; per producer \(batches and images over the whole run, "
                     r"images/s over the [\d.]+ s timed above\):$", out.stdout, re.M), out.stdout
    lines = re.findall(r"^  (\S+): [\d,]+ batches, [\d,]+ images, \d+ images/s$", out.stdout, re.M)
    assert sorted(lines) == sorted([p0.producer_id, p1.producer_id]), out.stdout


def test_the_train_summary_counts_connected_producers_that_sent_no_batch():
    from stoker.consumer.receive.input_stats import InputStats
    from stoker.consumer.train.run_summary import TrainReport

    stats = InputStats(batches=3, per_producer={"vm:5555#auto~3fa2c1": 3},
                       samples_per_producer={"vm:5555#auto~3fa2c1": 24}, connected_producers=2)
    report = TrainReport(steps=3, seconds=2.0, images_per_s=12.0, mean_queue_occupancy=0.5, final_loss=1.0,
                         final_accuracy=0.5, input_stats=stats)
    assert report.producer_lines() == ["vm:5555#auto~3fa2c1: 3 batches, 24 images, 12 images/s",
                                       "1 more connected producer(s): 0 batches (a producer is named by its first "
                                       "batch)"]
    assert "  1 more connected producer(s): 0 batches" in report.summary()
