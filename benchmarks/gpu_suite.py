#!/usr/bin/env python3
"""Every GPU figure in one command: correctness, latency hiding, producer scaling, trainer ingest.

    python benchmarks/gpu_suite.py            # on a machine with a GPU: about 15-25 minutes
    python benchmarks/gpu_suite.py --dry      # no GPU: CPU devices, tiny model, about a minute

Sections (each in its own process: TensorFlow fixes its devices when it starts, and a crash
in one section is reported without losing the others):

1. ``correctness``: two producers serve a dataset whose pixels are known (checksum_pipeline.py);
   the batches staged on ``/GPU:0`` are checksummed there and compared with checksums of the
   dataset's bytes, by the record index each row carries; then the same with per-replica
   staging under MirroredStrategy on two logical GPUs cut from the first physical one. Reports
   samples checked, mismatches, and the devices of the Unstage ops (one per device, no other);
   the staged tensors of the one-device run are also asked where they live.
2. ``latency_float32`` and ``latency_mixed_float16``: ResNet-50 training steps fed by a constant
   batch vs by ``ZMQInput`` (default arguments) from two local ``--repeat-batches`` producers;
   median step times over interleaved rounds, ratio zmq / constant (goal <= 1.02), and the
   queue occupancy. Then a TensorFlow profiler trace of a few ZMQInput-fed steps: the share of
   host-to-device copy time (``MemcpyH2D`` events on the GPU plane of the trace) that runs while
   a compute kernel runs on another stream. A share near 1 means the StagingArea hides the copy.
3. ``scaling``: producer_throughput.py with ``--workers 1,2,4,8,14`` (capped to the cores):
   images/s delivered and the fraction of linear, ``rate(N) / (N x rate(1))``.
4. ``ingest``: trainer_ingest.py with the trainer pinned to 4 cores and the producers to the
   others: ZMQInput (default arguments) against a bare receive loop, 1 and 4 producers.
5. ``torch_correctness`` and ``torch_latency`` (where PyTorch is installed; gpu_torch.py): the same
   checksums taken on the device TorchInput staged each batch on, torchvision ResNet-50 step time fed
   by TorchInput vs a constant device batch (goal <= 1.02), and from ``torch.profiler`` the share of
   host-to-device copy time that overlaps compute on another stream.

Dry mode (``--dry``, and the default where nvidia-smi finds no GPU; a GPU TensorFlow cannot use is
an error saying how to fix it, not a silent CPU run) runs every section small on
CPU devices with a tiny CNN: a test runs it, so the suite cannot rot. Figures from dry mode
say nothing about GPUs. Writes ``gpu_suite.json`` and ``gpu_suite.md`` (a Markdown table to
paste into docs/performance.md) to ``--out-dir``; exits 1 if a section failed or correctness
found a mismatch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from gpu_torch import markdown_rows, section_torch_correctness, section_torch_latency
from harness import benchmark_parser, launch_sharded, producer_flags, write_json

HERE = Path(__file__).resolve().parent
HAS_TF = importlib.util.find_spec("tensorflow") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None
#: Each framework's sections run where it is installed: a PyTorch-only GPU host runs the PyTorch ones and the
#: framework-free producer sections (scaling, ingest), and the report says which were left out and why.
TF_SECTIONS = ("correctness", "latency_float32", "latency_mixed_float16")
TORCH_SECTIONS = ("torch_correctness", "torch_latency", "torch_latency_bf16")
SECTIONS = (TF_SECTIONS if HAS_TF else ()) + (TORCH_SECTIONS if HAS_TORCH else ()) + ("scaling", "ingest")


# ---- sizes of each mode ------------------------------------------------------------------------

def plan(dry: bool, cores: int, quick: bool = False) -> dict[str, Any]:
    """What each section runs: full size on a GPU machine, seconds in dry mode; ``quick``: GPU sizes with fewer
    steps, batches and worker counts, about 6 minutes in all (a short device lease)."""
    if dry:
        return {"device": "CPU", "check_size": 32, "check_batch": 8, "check_batches": 12, "check_records": 96,
                "model": "small-cnn", "image_size": 32, "batch_size": 16, "steps": 6, "warmup": 2, "rounds": 1,
                "profile_steps": 3, "workers": [1, 2][: max(1, min(2, cores))], "scaling_args":
                    ["--records", "32", "--image-size", "32", "--batch-size", "8", "--warmup", "2", "--batches", "6",
                     "--decoder-seconds", "0.5", "--rounds", "1"],
                "ingest_args": ["--producers", "1", "--rounds", "1", "--warmup", "3", "--batches", "10",
                                "--batch-size", "8", "--image-size", "32"], "timeout_s": 240}
    workers = [w for w in ((1, 4, 14) if quick else (1, 2, 4, 8, 14)) if w <= max(1, cores - 2)]
    if quick:
        return {"quick": True, "device": "GPU", "check_size": 224, "check_batch": 64, "check_batches": 100, "check_records": 1024,
                "model": "resnet50", "image_size": 224, "batch_size": 128, "steps": 30, "warmup": 10, "rounds": 3,
                "profile_steps": 10, "workers": workers, "scaling_args": ["--records", "512", "--batches", "150",
                                                                          "--rounds", "1"],
                "ingest_args": ["--producers", "1,4", "--rounds", "2", "--batches", "300"], "timeout_s": 150}
    return {"device": "GPU", "check_size": 224, "check_batch": 64, "check_batches": 200, "check_records": 1024,
            "model": "resnet50", "image_size": 224, "batch_size": 128, "steps": 50, "warmup": 10, "rounds": 3,
            "profile_steps": 10, "workers": workers, "scaling_args":
                ["--records", "512", "--batches", "300", "--rounds", "1"],
            "ingest_args": ["--producers", "1,4", "--rounds", "3", "--batches", "400"], "timeout_s": 900}


def cpu_split(cores: int) -> tuple[str, str]:
    """(trainer cores, producer cores) as taskset-style lists: 4 for the trainer where there are 8+."""
    if cores < 2:
        return "", ""
    trainer = 4 if cores >= 8 else 1
    return f"0-{trainer - 1}", f"{trainer}-{cores - 1}"


# ---- section 1: correctness --------------------------------------------------------------------

def section_correctness(p: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf

    from checksum_pipeline import build_checksum_lmdb, checksum_weights
    from stoker.consumer import ZMQInput

    physical = tf.config.list_physical_devices(p["device"])[0]
    limit = {} if p["device"] == "CPU" else {"memory_limit": 4096}  # MB each; batches are ~10 MB
    tf.config.set_logical_device_configuration(physical, [tf.config.LogicalDeviceConfiguration(**limit)] * 2)
    devices = [d.name for d in tf.config.list_logical_devices(p["device"])]
    size, batch = p["check_size"], p["check_batch"]
    out: dict[str, Any] = {"devices": devices}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        expected = build_checksum_lmdb(Path(tmp) / "checks", p["check_records"], size)
        flags = ["--pipeline", f"{HERE / 'checksum_pipeline.py'}:make_pipeline", "--pipeline-arg", f"size={size}",
                 *producer_flags(batch)]
        addresses = [p.endpoint for p in launch_sharded(stack, Path(tmp) / "checks", 2, flags)]

        def compare(index: np.ndarray, sums: np.ndarray) -> int:
            return int(sum(expected[int(i)] != int(s) for i, s in zip(index, sums)))

        # One device: what get() stages on devices[0].
        with ZMQInput(addresses, device=devices[0], recv_timeout=60) as inp:
            with tf.device(devices[0]):
                weights = tf.constant(checksum_weights(size))

            @tf.function
            def step():
                b = inp.get()
                sums = tf.reduce_sum(tf.cast(b["images"], tf.int64) * weights, axis=[1, 2, 3])
                return b["index"], sums, b["images"]

            mismatches = samples = 0
            tensor_devices: set[str] = set()
            for _ in range(p["check_batches"]):
                index, sums, images = step()
                mismatches += compare(index.numpy(), sums.numpy())
                samples += len(index)
                tensor_devices.add(images.device)
            unstage = sorted({op.device for op in step.get_concrete_function().graph.get_operations()
                              if op.type == "Unstage"})
        out["one_device"] = {"device": devices[0], "samples": samples, "mismatches": mismatches,
                             "unstage_devices": unstage, "tensor_devices": sorted(tensor_devices)}

        # Per replica: one StagingArea per device under MirroredStrategy.
        strategy = tf.distribute.MirroredStrategy(devices)
        with ZMQInput(addresses, strategy=strategy, recv_timeout=60) as inp:
            def replica_fn():
                b = inp.get()  # staged on this replica's device; the constant below is placed beside it
                sums = tf.reduce_sum(tf.cast(b["images"], tf.int64) * tf.constant(checksum_weights(size)), axis=[1, 2, 3])
                return b["index"], sums, b["images"]

            @tf.function
            def replica_step():
                return strategy.run(replica_fn)

            mismatches = samples = 0
            for _ in range(p["check_batches"]):
                index, sums, _ = replica_step()
                for r in range(len(devices)):
                    i, s = (strategy.experimental_local_results(t)[r].numpy() for t in (index, sums))
                    mismatches += compare(i, s)
                    samples += len(i)
            unstage = sorted({op.device for op in replica_step.get_concrete_function().graph.get_operations()
                              if op.type == "Unstage"})
        out["per_replica"] = {"devices": devices, "samples": samples, "mismatches": mismatches,
                              "unstage_devices": unstage}

    def staged_on(unstage: list[str], wanted: list[str]) -> bool:  # each wanted device has its Unstage, no other
        short = sorted(d.lower().split("device:")[-1] for d in unstage)
        return short == sorted(d.lower().split("device:")[-1] for d in wanted)

    one, per = out["one_device"], out["per_replica"]
    out["ok"] = (one["mismatches"] == 0 and per["mismatches"] == 0 and one["samples"] > 0 and per["samples"] > 0
                 and staged_on(one["unstage_devices"], devices[:1]) and staged_on(per["unstage_devices"], devices))
    return out


# ---- section 2: latency hiding -----------------------------------------------------------------

def copy_compute_overlap(logdir: Path) -> dict[str, Any]:
    """From a profiler trace (``*.xplane.pb``): how much host-to-device copy time overlaps compute.

    GPU: ``MemcpyH2D`` events on a ``/device:GPU:*`` plane against kernels on its other streams.
    No GPU plane (dry mode): the same measure on the host plane, ``Stage`` ops (the copy into the
    StagingArea) against the step's other TensorFlow ops on other threads. Returns the event
    counts, copy time and the overlapped share (None when there were no copy events to judge).
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    copies: list[tuple[int, int]] = []
    compute: list[tuple[int, int]] = []
    planes_seen: list[str] = []
    files = sorted(logdir.rglob("*.xplane.pb"))
    gpu = False
    for f in files:
        space = xplane_pb2.XSpace()
        space.ParseFromString(f.read_bytes())
        gpu |= any(pl.name.startswith("/device:GPU:") for pl in space.planes)
    for f in files:
        space = xplane_pb2.XSpace()
        space.ParseFromString(f.read_bytes())
        for plane in space.planes:
            planes_seen.append(plane.name)
            on_gpu = plane.name.startswith("/device:GPU:")
            if gpu != on_gpu or (not gpu and plane.name != "/host:CPU"):
                continue
            names = {k: m.name for k, m in plane.event_metadata.items()}
            for line in plane.lines:
                if on_gpu and not line.name.startswith("Stream"):
                    continue  # derived lines (TF ops, steps) repeat what the streams hold
                base = line.timestamp_ns * 1000
                for ev in line.events:
                    name = names.get(ev.metadata_id, "")
                    span = (base + ev.offset_ps, base + ev.offset_ps + ev.duration_ps, line.id)
                    lowered = name.lower()
                    if on_gpu:
                        if "memcpyh2d" in lowered or ("memcpy" in lowered and "htod" in lowered):
                            copies.append(span)
                        elif "memcpy" not in lowered and "memset" not in lowered:
                            compute.append(span)
                    else:
                        op = name.split(":")[-1]
                        if op == "Stage":
                            copies.append(span)
                        elif op not in ("Unstage", "StageSize", "QueueDequeueV2", "QueueDequeueManyV2") and ":" in name:
                            compute.append(span)
    copy_ps = sum(e - s for s, e, _ in copies)
    overlapped = 0
    for s, e, line in copies:
        others = sorted((max(s, cs), min(e, ce)) for cs, ce, cl in compute if cl != line and cs < e and ce > s)
        covered, reach = 0, s
        for a, b in others:
            a = max(a, reach)
            if b > a:
                covered += b - a
                reach = b
        overlapped += covered
    return {"where": "gpu" if gpu else "host", "copy_events": len(copies), "compute_events": len(compute),
            "copy_ms": copy_ps / 1e9, "overlapped_share": overlapped / copy_ps if copy_ps else None,
            "trace_files": len(files), "planes": sorted(set(planes_seen))}


def section_latency(p: dict[str, Any], precision: str) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf

    from stoker.consumer import ZMQInput
    from stoker.consumer.train.models import build_model
    from harness import mean_step_seconds  # the same measure as trainer_latency.py
    from stoker.producer.dataset.build.synthetic import build_synthetic

    tf.keras.mixed_precision.set_global_policy(precision)
    device = "/GPU:0" if p["device"] == "GPU" else "/CPU:0"
    size, batch, classes = p["image_size"], p["batch_size"], 1000
    with tf.device(device):
        model = build_model(p["model"], size, classes)
    optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)  # no loss scaling: step time is what is measured
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, tf.cast(model(images, training=True), tf.float32))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    rng = np.random.default_rng(0)
    with tf.device(device):
        const_images = tf.constant(rng.integers(0, 255, (batch, size, size, 3), dtype=np.uint8))
        const_labels = tf.constant(np.arange(batch, dtype=np.int32) % classes)
    constant_step = tf.function(lambda: train(const_images, const_labels))

    flags = producer_flags(batch, size, repeat_batches=True)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        build_synthetic(Path(tmp) / "synth", 64, seed=0, progress=False)
        addresses = [p.endpoint for p in launch_sharded(stack, Path(tmp) / "synth", 2, flags)]
        inp = stack.enter_context(ZMQInput(addresses, device=device, recv_timeout=120))

        @tf.function
        def zmq_step() -> tf.Tensor:
            images, labels = inp.get()
            return train(images, labels)

        constant_s, zmq_s = [], []
        for _ in range(p["rounds"]):
            constant_s.append(mean_step_seconds(constant_step, p["steps"], p["warmup"]))
            zmq_s.append(mean_step_seconds(zmq_step, p["steps"], p["warmup"]))
        occupancy = inp.stats.mean_queue_occupancy
        logdir = Path(tmp) / "trace"
        tf.profiler.experimental.start(str(logdir))
        for _ in range(p["profile_steps"]):
            loss = zmq_step()
        float(loss)
        tf.profiler.experimental.stop()
        overlap = copy_compute_overlap(logdir)
    const, zmq = statistics.median(constant_s), statistics.median(zmq_s)
    out = {"model": p["model"], "precision": precision, "device": device, "batch_size": batch, "image_size": size,
           "constant_ms": 1000 * const, "zmq_ms": 1000 * zmq, "ratio": zmq / const, "goal": 1.02,
           "goal_met": zmq / const <= 1.02, "images_per_s": batch / zmq, "queue_occupancy": occupancy,
           "overlap": overlap, "rounds": {"constant_s": constant_s, "zmq_s": zmq_s}, "ok": True}
    if p["device"] == "GPU" and overlap["where"] != "gpu":
        out["ok"], out["error"] = False, ("the trace has no GPU plane: the profiler could not trace the GPU (CUPTI "
                                          "missing or not permitted in this container?); the overlap is not measured")
    elif overlap["copy_events"] == 0:
        out["ok"], out["error"] = False, ("the trace holds no host-to-device copy events: the overlap is not measured "
                                          f"(planes seen: {', '.join(overlap['planes'])})")
    return out


# ---- sections 3 and 4: the CPU side, through the existing benchmarks ---------------------------

def _run_benchmark(script: str, args: list[str], out: Path, timeout: float) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(HERE / script), *args, "--out", str(out)], capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{script} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def section_scaling(p: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        raw = _run_benchmark("producer_throughput.py", [*p["scaling_args"], "--workers", ",".join(map(str, p["workers"]))],
                             Path(tmp) / "scaling.json", p["timeout_s"])
    one = next(r["images_per_s"] for r in raw["rows"] if r["workers"] == 1)
    rows = [{"workers": r["workers"], "images_per_s": r["images_per_s"],
             "fraction_of_linear": r["images_per_s"] / (r["workers"] * one),
             "fraction_of_bare_loops_at_once": r["fraction_of_bare_loops_at_once"], "cores": r["cores"]}
            for r in raw["rows"]]
    return {"rows": rows, "decoder_limit_images_per_s": raw["decoder_limit_images_per_s"], "ok": True}


def section_ingest(p: dict[str, Any]) -> dict[str, Any]:
    trainer, producers = cpu_split(os.cpu_count() or 1)
    pin = ["--trainer-cpus", trainer, "--producer-cpus", producers] if trainer else []
    with tempfile.TemporaryDirectory() as tmp:
        raw = _run_benchmark("trainer_ingest.py", [*p["ingest_args"], *pin], Path(tmp) / "ingest.json", p["timeout_s"])
    rows = [{"producers": r["producers"], "bare_images_per_s": r["bare_images_per_s"],
             "bare_cpu_s_per_gb": r["bare_cpu_s_per_gb"],
             **({"zmq_images_per_s": r["direct_images_per_s"], "ratio": r["direct_ratio"],
                 "zmq_cpu_s_per_gb": r["direct_cpu_s_per_gb"], "cpu_ratio": r["direct_cpu_ratio"],
                 "zmq_gb_per_s": r["direct_gb_per_s"]} if "direct_ratio" in r else {}),
             **({key: r[key] for key in ("torch_images_per_s", "torch_cpu_s_per_gb", "torch_ratio", "torch_cpu_ratio")}
                if "torch_ratio" in r else {})} for r in raw["rows"]]
    return {"rows": rows, "trainer_cpus": trainer, "producer_cpus": producers, "ok": True}


# ---- the report --------------------------------------------------------------------------------

def markdown(result: dict[str, Any]) -> str:
    s = result["sections"]
    lines = [f"### GPU suite: {result['mode']} mode, {result['gpu'] or 'no GPU'}, {result['cpus']} cores, "
             f"TensorFlow {result['tensorflow'] or 'not installed'}, PyTorch {result.get('torch') or 'not installed'}"
             + (" (quick sizes)" if result["plan"].get("quick") else ""), ""]
    if result.get("left_out"):
        lines += ["Left out: " + "; ".join(result["left_out"]), ""]
    c = s.get("correctness", {})
    if c.get("ok") is not None and "one_device" in c:
        lines += ["| correctness | samples checked | mismatches | Unstage ops on |", "|---|---|---|---|"]
        for key in ("one_device", "per_replica"):
            r = c[key]
            lines.append(f"| {key.replace('_', ' ')} | {r['samples']} | {r['mismatches']} | "
                         f"{', '.join(d.split('device:')[-1] for d in r['unstage_devices'])} |")
        lines.append("")
    latency = [s[k] for k in ("latency_float32", "latency_mixed_float16") if "ratio" in s.get(k, {})]
    if latency:
        lines += ["| model | precision | batch | constant ms | ZMQInput ms | ratio (goal <= 1.02) | queue | "
                  "copy overlapped |", "|---|---|---|---|---|---|---|---|"]  # ratio marked * where the goal is missed
        for r in latency:
            share = r["overlap"]["overlapped_share"]
            lines.append(f"| {r['model']} | {r['precision']} | {r['batch_size']} | {r['constant_ms']:.1f} | "
                         f"{r['zmq_ms']:.1f} | {r['ratio']:.3f}{'' if r['goal_met'] else ' *'} | {r['queue_occupancy']:.2f} | "
                         f"{'n/a' if share is None else f'{share:.2f}'} ({r['overlap']['where']}, "
                         f"{r['overlap']['copy_events']} copies) |")
        lines.append("")
    if "rows" in s.get("scaling", {}):
        lines += ["| producer workers | images/s | fraction of linear | of N bare loops |", "|---|---|---|---|"]
        lines += [f"| {r['workers']} | {r['images_per_s']:.0f} | {r['fraction_of_linear']:.2f} | "
                  f"{r['fraction_of_bare_loops_at_once']:.2f} |" for r in s["scaling"]["rows"]]
        lines.append("")
    for facade, key in (("ZMQInput", "zmq"), ("TorchInput", "torch")):
        rows = [r for r in s.get("ingest", {}).get("rows", []) if f"{key}_images_per_s" in r]
        if not rows:
            continue
        ratio, cpu_ratio = ("ratio", "cpu_ratio") if key == "zmq" else ("torch_ratio", "torch_cpu_ratio")
        lines += [f"| producers (cores {s['ingest']['producer_cpus'] or 'shared'}) | bare img/s | {facade} img/s | "
                  f"ratio | CPU s/GB bare | {facade} | CPU ratio |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['producers']} | {r['bare_images_per_s']:.0f} | {r[f'{key}_images_per_s']:.0f} | {r[ratio]:.3f} | "
                  f"{r['bare_cpu_s_per_gb']:.3f} | {r[f'{key}_cpu_s_per_gb']:.3f} | {r[cpu_ratio]:.2f} |" for r in rows]
        lines.append("")
    lines += markdown_rows(s)
    failed = [f"{k}: {v['error'].splitlines()[0] if v.get('error') else 'failed'}" for k, v in s.items() if not v.get("ok")]
    if failed:
        lines += ["Failed: " + "; ".join(failed), ""]
    return "\n".join(lines)


def run_section(name: str, p: dict[str, Any]) -> dict[str, Any]:
    if name == "correctness":
        return section_correctness(p)
    if name.startswith("latency_"):
        return section_latency(p, name.removeprefix("latency_"))
    if name == "scaling":
        return section_scaling(p)
    if name == "torch_correctness":
        return section_torch_correctness(p)
    if name.startswith("torch_latency"):
        return section_torch_latency(p, "bf16" if name.endswith("_bf16") else "float32")
    return section_ingest(p)


def gpu_name() -> str:
    done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True) \
        if _which("nvidia-smi") else None
    return done.stdout.strip().splitlines()[0] if done and done.returncode == 0 and done.stdout.strip() else ""


def tensorflow_gpus() -> int:
    """GPUs TensorFlow itself sees, asked in a fresh process (this one must not fix its devices yet)."""
    done = subprocess.run([sys.executable, "-c", "import tensorflow as tf; print(len(tf.config.list_physical_devices('GPU')))"],
                          capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    try:
        return int(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


def _version(module: str) -> str | None:
    """An installed module's version without importing it (TensorFlow's import fixes devices, and takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    if importlib.util.find_spec(module) is None:
        return None
    for dist in {"tensorflow": ("tensorflow", "tensorflow-cpu"), "torch": ("torch",)}.get(module, (module,)):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def _write(out_dir: Path, result: dict[str, Any]) -> str:
    """gpu_suite.json and gpu_suite.md as they stand; returns the Markdown."""
    table = markdown(result)
    write_json(out_dir / "gpu_suite.json", result)
    (out_dir / "gpu_suite.md").write_text(table + "\n")
    return table


def _which(command: str) -> bool:
    return any((Path(d) / command).exists() for d in os.environ.get("PATH", "").split(os.pathsep))


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--dry", action="store_true", help="CPU devices and a tiny model (the default without a GPU)")
    parser.add_argument("--quick", action="store_true", help="GPU sizes, fewer steps: about 6 minutes (a short lease)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    parser.add_argument("--out-dir", default=str(HERE / "results"), help="where gpu_suite.json and gpu_suite.md go")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section in this process
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.section:
        Path(args.result).write_text(json.dumps(run_section(args.section, json.loads(args.plan))))
        return 0

    gpu = gpu_name()
    dry = args.dry or not gpu
    if not args.dry and not gpu:
        print("no GPU found (nvidia-smi): running the dry mode; its figures say nothing about GPUs")
    if not dry and HAS_TF and tensorflow_gpus() == 0:
        print(f"nvidia-smi shows {gpu}, but TensorFlow sees no GPU: this environment has a CPU-only TensorFlow or "
              "mismatched CUDA libraries. Install the GPU build (pip install -e '.[train]' 'tensorflow[and-cuda]'), "
              "check `python -c \"import tensorflow as tf; print(tf.config.list_physical_devices('GPU'))\"`, and run "
              "again; --dry runs the CPU dry mode instead.")
        return 2
    cores = os.cpu_count() or 1
    p = plan(dry, cores, args.quick)
    left_out = [f"{', '.join(names)}: {framework} is not installed" for names, framework, has in
                ((TF_SECTIONS, "TensorFlow", HAS_TF), (TORCH_SECTIONS, "PyTorch", HAS_TORCH)) if not has]
    result: dict[str, Any] = {"benchmark": "gpu_suite", "mode": "dry" if dry else "gpu", "gpu": "" if dry else gpu,
                              "cpus": cores, "tensorflow": _version("tensorflow"), "torch": _version("torch"),
                              "python": platform.python_version(), "plan": p, "left_out": left_out, "sections": {}}
    for line in left_out:
        print(f"left out: {line}")
    names = [name for name in args.sections.split(",") if name]
    for name in names:
        if name not in SECTIONS:
            parser.error(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}"
                         + (f" (left out: {'; '.join(left_out)})" if left_out else ""))
    started = time.monotonic()
    out_dir = Path(args.out_dir)
    for name in names:
        print(f"== {name}", flush=True)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            try:
                done = subprocess.run([sys.executable, __file__, "--section", name, "--plan", json.dumps(p),
                                       "--result", str(out)], capture_output=True, text=True, timeout=p["timeout_s"] * 2)
                if done.returncode == 0:
                    section = json.loads(out.read_text())
                else:
                    section = {"ok": False, "error": f"exited {done.returncode}: {done.stderr[-3000:]}"}
            except subprocess.TimeoutExpired:
                section = {"ok": False, "error": f"timed out after {p['timeout_s'] * 2} s"}
        section["seconds"] = time.monotonic() - t0
        result["sections"][name] = section
        print(f"   {'ok' if section.get('ok') else 'FAILED'} in {section['seconds']:.0f} s"
              + (f": {section['error'][-600:]}" if section.get("error") else ""), flush=True)
        result["seconds"] = time.monotonic() - started
        _write(out_dir, result)  # after each section: a run cut short keeps what it measured
    table = _write(out_dir, result)
    print(table)
    print(f"wrote {out_dir / 'gpu_suite.json'} and {out_dir / 'gpu_suite.md'} in {result['seconds']:.0f} s")
    return 0 if all(s.get("ok") for s in result["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
