"""TorchInput: the receive core into torch tensors, with real producers, real sockets and real PyTorch (CPU).

The CUDA path (pinned memory, the side stream) cannot run here; everything it shares with the CPU path
(the sink, staging, conversions, exact mode's bookkeeping, state) is tested through the CPU device.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import threading
from collections import Counter

import numpy as np
import pytest

if not os.environ.get("CI"):  # CI installs the extra (.ci/run): there a missing torch fails the run
    pytest.importorskip("torch", reason="the stoker[torch] extra is not installed (.ci/run installs it)")
import torch

from stoker.consumer import InputClosedError, InputTimeoutError, TorchInput
from stoker.consumer.receive.contract import SinkClosed
from stoker.consumer.torch.device_prefetch import DevicePrefetch, convert
from stoker.consumer.receive.queue_sink import END
from stoker.consumer.torch.pinned_sink import PinnedSink
from stoker.consumer.torch.torch_input import default_share
from stoker.producer.process import ProducerProcess
from stoker.producer.dataset.build.synthetic import build_synthetic

from conftest import CHECKSUM_WEIGHTS as WEIGHTS, EVAL_SIZE as SIZE, one_worker_producer

pytestmark = pytest.mark.timeout(180)

BATCH = 8
CPU = torch.device("cpu")


_producer = functools.partial(one_worker_producer, batch=BATCH, size=SIZE)


def _record(images: np.ndarray, record_by_checksum) -> list[tuple[int, int]]:
    weights = np.asarray(WEIGHTS, np.int64)
    return [record_by_checksum[int((image.astype(np.int64) * weights).sum())] for image in images]


# ---- the sink and the staging, without sockets ------------------------------------------------------------

def test_the_sink_hands_out_the_very_tensors_the_receiver_read_into_and_copies_read_only_frames_once():
    sink = PinnedSink(capacity=2, pin=False)
    received = sink.empty(np.dtype("uint8"), (4, 5, 5, 3))  # what a direct receiver reads a message into
    received[...] = 7
    frame = np.arange(4, dtype=np.int64)
    frame.flags.writeable = False  # a view of a libzmq frame
    sink.put([received], owned=True)
    sink.put([frame], owned=False)
    (owned,), (copied,) = sink.take(1.0), sink.take(1.0)
    assert isinstance(owned, torch.Tensor) and owned.data_ptr() == received.ctypes.data  # no copy
    assert owned is received.base, "the tensor empty() made (its numpy() keeps it as base), not a wrapper"
    assert owned.dtype == torch.uint8 and bool((owned == 7).all()) and owned.data_ptr() % 64 == 0
    assert copied.data_ptr() != frame.ctypes.data and copied.tolist() == [0, 1, 2, 3]
    assert not copied.is_pinned() and sink.take(0.0) is None


def test_the_sink_holds_at_most_its_capacity_ends_after_what_it_holds_and_refuses_puts_once_closed():
    sink = PinnedSink(capacity=1, pin=False)
    sink.put([sink.empty(np.dtype("int32"), (2,))], owned=True)
    second = threading.Thread(target=sink.put, args=([np.zeros(2, np.int32)], False))
    second.start()
    second.join(0.3)
    assert second.is_alive() and sink.size() == 1  # waits for room
    assert sink.take(1.0) is not None
    second.join(10)
    assert not second.is_alive() and sink.size() == 1
    sink.end()
    assert sink.take(1.0) is not None and sink.take(1.0) is END
    sink.close(cancel=True)
    with pytest.raises(SinkClosed):
        sink.put([np.zeros(2, np.int32)], owned=False)


def test_staging_on_the_cpu_keeps_order_and_notes_and_holds_at_most_prefetch_batches():
    staging = DevicePrefetch(CPU, prefetch=2)
    host = [{"images": torch.full((2, 4, 4, 3), i, dtype=torch.uint8)} for i in range(3)]
    staging.stage(host[0], note="a")
    assert not staging.full()
    staging.stage(host[1], note="b")
    assert staging.full() and len(staging) == 2
    first, note = staging.pop()
    assert note == "a" and first["images"] is host[0]["images"]  # on the CPU the host tensor itself: no copy
    staging.stage(host[2], note="c")
    assert [staging.pop()[1] for _ in range(2)] == ["b", "c"] and len(staging) == 0
    staging.close()
    with pytest.raises(ValueError, match="prefetch=0"):
        DevicePrefetch(CPU, prefetch=0)


def test_channels_last_is_a_view_of_the_nhwc_bytes_and_dtypes_convert_without_changing_values():
    images = torch.randint(0, 256, (2, 5, 6, 3), dtype=torch.uint8)
    labels = torch.tensor([1, 2], dtype=torch.int32)
    out = convert({"images": images, "labels": labels}, CPU, True, {}, False)
    assert out["images"].shape == (2, 3, 5, 6) and out["images"].data_ptr() == images.data_ptr()
    assert out["images"].is_contiguous(memory_format=torch.channels_last) and out["labels"] is labels
    out = convert({"images": images, "labels": labels}, CPU, True, {"images": torch.float16}, False)
    assert out["images"].dtype == torch.float16 and out["images"].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out["images"].permute(0, 2, 3, 1).to(torch.uint8), images)


def test_share_comes_from_the_argument_else_from_torch_distributed_in_exact_mode_only():
    assert not torch.distributed.is_initialized()
    assert default_share(None, exact=True) == (0, 1) and default_share(None, exact=False) == (0, 1)
    assert default_share((1, 3), exact=True) == (1, 3)
    # under an initialised process group: the torchrun test below (each rank checks its share)


# ---- with producers -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("receive", ["auto", "libzmq"])
def test_batches_are_the_callers_tensors_in_torchs_memory_with_the_eval_transforms_pixels(
        synth_lmdb, record_by_checksum, receive):
    with _producer(synth_lmdb, "--mode", "eval") as producer, \
            TorchInput([producer.endpoint], recv_timeout=30, receive=receive) as inp:
        assert inp.receive == ("direct" if receive == "auto" else "libzmq") and inp.device == CPU
        kept = []
        for _, batch in zip(range(6), inp):
            images, labels = batch["images"], batch["labels"]
            assert images.shape == (BATCH, SIZE, SIZE, 3) and images.dtype == torch.uint8
            assert labels.dtype == torch.int32 and batch["index"].dtype == torch.int64
            assert images.is_contiguous() and images.data_ptr() % 64 == 0
            assert images.is_pinned() == torch.cuda.is_available()
            for (index, true_label), label in zip(_record(images.numpy(), record_by_checksum), labels.tolist()):
                assert label == true_label and index in batch["index"].tolist()
            kept.append((batch, images.clone()))
        for _ in zip(range(6), inp):  # later batches never write into the ones handed out
            pass
        for batch, snapshot in kept:
            assert torch.equal(batch["images"], snapshot)
        stats = inp.stats
        assert stats.batches >= 12 and stats.protocol_errors == 0 and 0.0 <= inp.queue_occupancy() <= 1.0
        assert inp.max_batches_held() == 8 + 2 + 1 + inp._core.receiver.held_per_producer


def test_channels_last_and_float_images_keep_each_records_pixels(synth_lmdb, record_by_checksum):
    with _producer(synth_lmdb, "--mode", "eval") as producer, \
            TorchInput([producer.endpoint], recv_timeout=30, channels_last=True, prefetch=3,
                       dtypes={"images": torch.float32}) as inp:
        for _, batch in zip(range(4), inp):
            images = batch["images"]
            assert images.shape == (BATCH, 3, SIZE, SIZE) and images.dtype == torch.float32
            assert images.is_contiguous(memory_format=torch.channels_last)
            nhwc = images.permute(0, 2, 3, 1).to(torch.uint8).numpy()
            assert [i for i, _ in _record(nhwc, record_by_checksum)] == batch["index"].tolist()


def test_arguments_that_cannot_work_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="prefetch=0"):
        TorchInput(["tcp://127.0.0.1:1"], batch_size=BATCH, prefetch=0)
    with pytest.raises(ValueError, match="torch.dtype"):
        TorchInput(["tcp://127.0.0.1:1"], batch_size=BATCH, dtypes={"images": "float16"})
    with pytest.raises(ValueError, match=r"dtypes names \['pixels'\]"):
        TorchInput(["tcp://127.0.0.1:1"], batch_size=BATCH, dtypes={"pixels": torch.float16})
    with pytest.raises(ValueError, match="'cpu' or 'cuda:N'"):
        TorchInput(["tcp://127.0.0.1:1"], batch_size=BATCH, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch.cuda.is_available"):
            TorchInput(["tcp://127.0.0.1:1"], batch_size=BATCH, device="cuda:0")
        with pytest.raises(ValueError, match="pinned memory needs CUDA"):
            TorchInput(["tcp://127.0.0.1:1"], batch_size=BATCH, pin_memory=True)
    with pytest.raises(ValueError, match="share"):  # a share belongs to exact mode, as for every facade
        TorchInput(["tcp://127.0.0.1:1"], batch_size=BATCH, share=(0, 2))


def test_no_producer_ends_the_iteration_with_the_timeout_that_says_why():
    with TorchInput(["tcp://127.0.0.1:1"], batch_size=BATCH, recv_timeout=1) as inp:
        with pytest.raises(InputTimeoutError, match="nothing arrived: check the producers run"):
            next(inp)
    with pytest.raises(InputTimeoutError, match="waited for a first batch to learn it from"):
        TorchInput(["tcp://127.0.0.1:1"], recv_timeout=1)


def test_next_after_close_raises_closed_and_a_blocked_next_lets_go(synth_lmdb):
    with _producer(synth_lmdb) as producer:
        inp = TorchInput([producer.endpoint], recv_timeout=30)
        next(inp)
        inp.close()
        with pytest.raises(InputClosedError):
            next(inp)
    waiting = TorchInput(["tcp://127.0.0.1:1"], batch_size=BATCH, recv_timeout=60)
    errors: list[BaseException] = []

    def wait_for_a_batch() -> None:
        try:
            next(waiting)
        except BaseException as exc:
            errors.append(exc)

    consumer = threading.Thread(target=wait_for_a_batch)
    consumer.start()
    consumer.join(0.5)
    waiting.close()  # from another thread, while next() waits for a batch
    consumer.join(10)
    assert not consumer.is_alive() and isinstance(errors[0], InputClosedError)


# ---- exact mode: state ------------------------------------------------------------------------------------

def _finite_producer(tmp_path, records: int) -> ProducerProcess:
    data = tmp_path / "ds"
    build_synthetic(data, records, seed=1, num_classes=4, progress=False)
    return ProducerProcess(data, extra_args=["--workers", "1", "--batch-size", str(BATCH), "--image-size", "16",
                                             "--epochs", "1", "--seed", "5"])


@pytest.mark.parametrize("receive", ["auto", "libzmq"])
def test_a_state_dict_saved_with_torch_save_resumes_the_epoch_with_every_record_once(tmp_path, receive):
    records = 44  # not a multiple of the batch: the last batch is padded and cut
    seen: Counter = Counter()
    with _finite_producer(tmp_path, records) as producer:
        with TorchInput([producer.endpoint], exact=True, recv_timeout=60, receive=receive, prefetch=2) as first:
            for _, batch in zip(range(2), first):
                seen.update(batch["index"].tolist())
            torch.save(first.state_dict(), tmp_path / "input.pt")  # batches staged ahead are not in it
        with TorchInput([producer.endpoint], exact=True, recv_timeout=60, receive=receive) as second:
            second.load_state_dict(torch.load(tmp_path / "input.pt"))
            assert second.trainer_id == first.trainer_id
            for batch in second:
                assert bool(batch["mask"].all()) and len(batch["index"]) <= BATCH
                assert len(batch["images"]) == len(batch["index"])
                seen.update(batch["index"].tolist())
            assert second.finished
            with pytest.raises(StopIteration):
                next(second)
    assert sorted(seen) == list(range(records)) and set(seen.values()) == {1}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single process, on purpose
def test_torch_distributed_checkpoint_saves_and_loads_the_input_as_a_stateful(tmp_path):
    import torch.distributed.checkpoint as dcp

    records = 40
    seen: Counter = Counter()
    model = torch.nn.Linear(2, 1)
    with _finite_producer(tmp_path, records) as producer:
        with TorchInput([producer.endpoint], exact=True, recv_timeout=60) as first:
            for _, batch in zip(range(3), first):
                seen.update(batch["index"].tolist())
            dcp.save({"model": model.state_dict(), "input": first}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
        with TorchInput([producer.endpoint], exact=True, recv_timeout=60) as second:
            fresh = torch.nn.Linear(2, 1)
            state = {"model": fresh.state_dict(), "input": second}
            dcp.load(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)  # calls second.load_state_dict
            fresh.load_state_dict(state["model"])
            assert torch.equal(fresh.weight, model.weight) and second.trainer_id == first.trainer_id
            for batch in second:
                seen.update(batch["index"].tolist())
    assert sorted(seen) == list(range(records)) and set(seen.values()) == {1}


def test_load_state_dict_names_what_is_wrong_and_comes_before_the_first_batch():
    with TorchInput(["tcp://127.0.0.1:1"], batch_size=BATCH, image_shape=(16, 16, 3), recv_timeout=1) as plain:
        with pytest.raises(ValueError, match="exact mode"):
            plain.state_dict()
    with TorchInput(["tcp://127.0.0.1:1"], exact=True, trainer_id="t7", batch_size=BATCH, image_shape=(16, 16, 3),
                    recv_timeout=1) as inp:
        good = inp.state_dict()
        assert set(good) == {"stoker_input_state", "version"} and good["stoker_input_state"] == inp.save_state()
        for bad, why in [("abc", "not a str"), ([], "no input state to merge"), ({"version": 1}, r"missing \['stoker_input_state'\]"),
                         ({**good, "epoch": 3}, r"unknown \['epoch'\]"), ({**good, "version": 2}, "newer Stoker"),
                         ({**good, "version": "1"}, "not a version number"),
                         ({**good, "stoker_input_state": "abc"}, "is a str, not the bytes"),
                         ({**good, "stoker_input_state": b"junk"}, "not an input state")]:
            with pytest.raises(ValueError, match=why):
                inp.load_state_dict(bad)
        inp.load_state_dict([good])  # the states of a job's ranks, merged: here a lone trainer's
        assert inp.trainer_id == "t7"
        inp.load_state_dict(good)
        assert inp.trainer_id == "t7"
        with pytest.raises(InputTimeoutError):
            next(inp)  # receiving started (and found nothing)
        with pytest.raises(RuntimeError, match="before the first"):
            inp.load_state_dict(good)


# ---- imports ----------------------------------------------------------------------------------------------

def test_stoker_consumer_imports_no_torch_and_torch_input_imports_no_tensorflow():
    code = textwrap.dedent("""
        import sys
        import stoker.consumer
        from stoker.consumer import BatchStream
        assert "torch" not in sys.modules, "import stoker.consumer pulled in PyTorch"
        import stoker.consumer.torch
        assert "torch" not in sys.modules, "the package stoker.consumer.torch imports PyTorch by itself"
        from stoker.consumer import TorchInput
        from stoker.consumer.torch import checkpoint_state, device_prefetch, pinned_sink, torch_input
        import torch
        assert torch_input.torch is torch and pinned_sink.torch is torch and device_prefetch.torch is torch
        assert torch.__file__ != stoker.consumer.torch.__file__ and hasattr(torch, "cuda")
        assert TorchInput is torch_input.TorchInput
        assert "tensorflow" not in sys.modules, "TorchInput pulled in TensorFlow"
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_consumed_when_marked_counts_a_batch_when_its_step_starts_not_when_it_was_fetched(tmp_path):
    """A loop that fetches ahead (Lightning's) marks each batch as its step starts: a state saved between the
    fetch and the mark holds only the marked batches, so a resumed input serves the fetched one again."""
    records = 40
    seen: Counter = Counter()
    with _finite_producer(tmp_path, records) as producer:
        with TorchInput([producer.endpoint], exact=True, recv_timeout=60, consumed_when="marked") as first:
            with pytest.raises(RuntimeError, match="every batch handed out is marked"):
                first.mark_consumed()
            trained, ahead = next(first), next(first)  # the loop fetched the second batch before training the first
            first.mark_consumed()
            seen.update(trained["index"].tolist())
            state = first.state_dict()  # a checkpoint now: `ahead` was fetched, never trained on
            assert not set(ahead["index"].tolist()) & set(trained["index"].tolist())
        with TorchInput([producer.endpoint], exact=True, recv_timeout=60) as second:
            second.load_state_dict(state)
            for batch in second:
                seen.update(batch["index"].tolist())
    assert sorted(seen) == list(range(records)) and set(seen.values()) == {1}


def test_consumed_when_is_checked():
    with pytest.raises(ValueError, match="choose 'next'"):
        TorchInput(["tcp://127.0.0.1:1"], exact=True, consumed_when="later", batch_size=BATCH, image_shape=(16, 16, 3))
    with pytest.raises(ValueError, match="belongs to exact mode"):
        TorchInput(["tcp://127.0.0.1:1"], consumed_when="marked", batch_size=BATCH, image_shape=(16, 16, 3))
    with TorchInput(["tcp://127.0.0.1:1"], exact=True, batch_size=BATCH, image_shape=(16, 16, 3),
                    recv_timeout=1) as inp:
        with pytest.raises(RuntimeError, match="consumed_when='marked'"):
            inp.mark_consumed()


def test_marked_mode_ends_a_finite_run_while_the_loop_holds_its_last_batch_unmarked(tmp_path):
    """A loop that fetches ahead asks for the batch after the last while the last is unmarked: the run's end waits
    for that batch's records, so next() counts what the loop holds when it must wait (review: it hung until
    recv_timeout). The marks owed for them are taken without error; a mark from another thread never waits for a
    blocked next()."""
    records = 24
    seen: Counter = Counter()
    with _finite_producer(tmp_path, records) as producer:
        with TorchInput([producer.endpoint], exact=True, recv_timeout=30, consumed_when="marked") as inp:
            held = next(inp)
            for ahead in inp:  # fetch the next batch, then train (mark) the one held: Lightning's order
                inp.mark_consumed()
                seen.update(held["index"].tolist())
                held = ahead
            inp.mark_consumed()  # the last batch: counted when next() waited for the end, its mark owed
            seen.update(held["index"].tolist())
            assert inp.finished
            with pytest.raises(RuntimeError, match="every batch handed out is marked"):
                inp.mark_consumed()
    assert sorted(seen) == list(range(records)) and set(seen.values()) == {1}


def test_a_torch_input_serves_the_same_prometheus_metrics_as_the_other_facades(synth_lmdb):
    import urllib.request

    with _producer(synth_lmdb) as producer:
        with TorchInput([producer.endpoint], recv_timeout=60) as inp:
            port = inp.serve_metrics(0, "127.0.0.1")
            for _, _batch in zip(range(3), inp):
                pass
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "stoker_trainer_batches_received_total{producer=" in text
        assert "stoker_trainer_queue_occupancy" in text
        with pytest.raises(OSError):  # closed with the input
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
