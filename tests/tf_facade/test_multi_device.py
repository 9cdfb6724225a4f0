"""Several devices in one trainer process: per-replica StagingAreas under MirroredStrategy, on CPU.

TensorFlow fixes its logical devices when it starts, so each test runs a script in a fresh
process that splits the CPU into two logical devices first.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from stoker.producer.process import ProducerProcess

from conftest import EVAL_SIZE, SYNTH_COUNT

pytestmark = pytest.mark.timeout(240)

PRELUDE = textwrap.dedent('''
    import json, sys
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    DEVICES = [d.name for d in tf.config.list_logical_devices("CPU")]
    from stoker.consumer import ZMQInput
    ADDRESSES = sys.argv[1].split(",")
''')


def _run(script: str, addresses: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(script), ",".join(addresses)],
                         capture_output=True, text=True, timeout=200, env={"PATH": "/usr/bin:/bin",
                                                                           "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def eval_producers(synth_lmdb):
    args = ["--workers", "1", "--batch-size", "8", "--image-size", str(EVAL_SIZE), "--mode", "eval", "--seed", "1"]
    with ProducerProcess(synth_lmdb, extra_args=[*args, "--shard", "0/2"]) as a, \
            ProducerProcess(synth_lmdb, extra_args=[*args, "--shard", "1/2"]) as b:
        yield [a.endpoint, b.endpoint]


def test_each_replica_gets_its_own_batch_staged_on_its_device_and_an_epoch_reaches_each_record_once(eval_producers):
    result = _run('''
        strategy = tf.distribute.MirroredStrategy(DEVICES)
        with ZMQInput(ADDRESSES, strategy=strategy, batch_size=8, image_shape=(32, 32, 3), recv_timeout=30) as inp:
            def replica_fn():
                batch = inp.get()
                return batch["index"], batch["epoch"], tf.reduce_sum(tf.cast(batch["images"], tf.int64))

            @tf.function
            def step():
                return strategy.run(replica_fn)

            steps = []
            for _ in range(40):
                index, epoch, _ = step()
                steps.append([[strategy.experimental_local_results(t)[r].numpy().tolist() for t in (index, epoch)]
                              for r in range(2)])
            graph = step.get_concrete_function().graph
            unstage = sorted({op.device for op in graph.get_operations() if op.type == "Unstage"})
        print(json.dumps({"steps": steps, "unstage_devices": unstage, "devices": DEVICES}))
    ''', eval_producers)
    assert len(result["unstage_devices"]) == 2 and all(d.endswith(("CPU:0", "CPU:1")) for d in result["unstage_devices"])
    per_record = {}
    for step in result["steps"]:
        (i0, e0), (i1, e1) = step
        assert not set(zip(i0, e0)) & set(zip(i1, e1)), "two replicas got the same batch"
        for replica, (indices, epochs) in enumerate(step):
            for index, epoch in zip(indices, epochs):
                if epoch == 0:
                    per_record.setdefault(index, []).append(replica)
    assert sorted(per_record) == list(range(SYNTH_COUNT)), "an epoch did not reach every record"
    assert all(len(r) == 1 for r in per_record.values()), "a record reached two replicas in one epoch"
    assert {r[0] for r in per_record.values()} == {0, 1}


def test_keras_fit_under_mirrored_strategy_trains_each_replica_on_a_whole_producer_batch(eval_producers):
    result = _run('''
        strategy = tf.distribute.MirroredStrategy(DEVICES)
        with ZMQInput(ADDRESSES, batch_size=8, image_shape=(32, 32, 3), recv_timeout=30) as inp:
            with strategy.scope():
                model = tf.keras.Sequential([tf.keras.Input((32, 32, 3), dtype="uint8"),
                                             tf.keras.layers.Rescaling(1 / 255), tf.keras.layers.Flatten(),
                                             tf.keras.layers.Dense(4)])
                model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            dataset = inp.as_dataset(combine=strategy.num_replicas_in_sync)
            shapes = [list(t.shape) for t in next(iter(dataset))]
            history = model.fit(dataset, steps_per_epoch=4, epochs=2, verbose=0, callbacks=[inp.keras_callback()])
        print(json.dumps({"loss": history.history["loss"], "shapes": shapes}))
    ''', eval_producers)
    assert result["shapes"] == [[16, 32, 32, 3], [16]]  # two producer batches per step, one per replica
    assert len(result["loss"]) == 2 and all(l == l for l in result["loss"])


def test_get_outside_strategy_run_with_several_devices_says_how_to_call_it(eval_producers):
    result = _run('''
        with ZMQInput(ADDRESSES, devices=DEVICES, batch_size=8, image_shape=(32, 32, 3), recv_timeout=30) as inp:
            try:
                inp.get()
                message = ""
            except ValueError as exc:
                message = str(exc)
        print(json.dumps({"message": message}))
    ''', eval_producers)
    assert "stages on 2 devices" in result["message"] and "inside strategy.run(replica_fn)" in result["message"]
