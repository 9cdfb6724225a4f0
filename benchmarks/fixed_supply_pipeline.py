"""A pipeline of fixed supply for the autoscale benchmark (``--pipeline benchmarks/fixed_supply_pipeline.py:
make_pipeline --pipeline-arg sample_s=0.01``): each sample sleeps ``sample_s`` instead of decoding, so one worker
makes 1 / sample_s images/s however many producers share the machine's cores. The sleep is the pipeline's time, so
it shows in the batch headers' stage times (as augment) and the trainers' capacity estimate sees it.

``gate=PATH`` with ``hold_after=K`` (for tests that need an order, not a margin): once a worker has made K samples
it waits, polling, until PATH exists, at most ``GATE_WAIT_S`` (then it goes on and says so: nothing hangs)."""

import os
import sys
import time

import numpy as np

from stoker.producer.pipeline import Field, Pipeline

#: The longest a worker waits at the gate before going on without it.
GATE_WAIT_S = 120.0
GATE_POLL_S = 0.05


def make_pipeline(sample_s: float = 0.01, images_px: int = 0, gate: str = "", hold_after: int = 0) -> Pipeline:
    """``images_px`` > 0: each sample also carries a black ``images`` array of that size (for ``stoker train``).
    ``gate``/``hold_after``: see the module doc (each worker counts its own samples)."""
    if not 0 <= sample_s <= 10 or not 0 <= images_px <= 1024:
        raise ValueError(f"sample_s must be 0-10 seconds and images_px 0-1024, got {sample_s} and {images_px}")
    if bool(gate) != (int(hold_after) > 0):
        raise ValueError(f"gate and hold_after > 0 go together, got gate={gate!r} and hold_after={hold_after}")
    image = np.zeros((images_px, images_px, 3), np.uint8)
    fields = [Field("images", "uint8", image.shape)] if images_px else []
    made = [0]  # this worker's samples (each worker is its own process, with its own pipeline)

    def sample(record, rng):
        made[0] += 1
        if gate and made[0] == int(hold_after) + 1:
            _wait_for(gate)
        time.sleep(sample_s)
        return {"labels": np.int32(record["label"]), **({"images": image} if images_px else {})}

    return Pipeline([*fields, Field("labels", "int32")], sample=sample, name=f"fixed supply ({sample_s:g} s per sample)")


def _wait_for(gate: str) -> None:
    deadline = time.monotonic() + GATE_WAIT_S
    while not os.path.exists(gate):
        if time.monotonic() >= deadline:
            print(f"fixed supply: gate {gate} not opened in {GATE_WAIT_S:g} s; going on without it", file=sys.stderr,
                  flush=True)
            return
        time.sleep(GATE_POLL_S)
