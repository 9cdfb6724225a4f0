"""A pipeline of fixed supply for the autoscale benchmark (``--pipeline benchmarks/fixed_supply_pipeline.py:
make_pipeline --pipeline-arg sample_s=0.01``): each sample sleeps ``sample_s`` instead of decoding, so one worker
makes 1 / sample_s images/s however many producers share the machine's cores. The sleep is the pipeline's time, so
it shows in the batch headers' stage times (as augment) and the trainers' capacity estimate sees it."""

import time

import numpy as np

from stoker.producer.pipeline import Field, Pipeline


def make_pipeline(sample_s: float = 0.01, images_px: int = 0) -> Pipeline:
    """``images_px`` > 0: each sample also carries a black ``images`` array of that size (for ``stoker train``)."""
    if not 0 <= sample_s <= 10 or not 0 <= images_px <= 1024:
        raise ValueError(f"sample_s must be 0-10 seconds and images_px 0-1024, got {sample_s} and {images_px}")
    image = np.zeros((images_px, images_px, 3), np.uint8)
    fields = [Field("images", "uint8", image.shape)] if images_px else []

    def sample(record, rng):
        time.sleep(sample_s)
        return {"labels": np.int32(record["label"]), **({"images": image} if images_px else {})}

    return Pipeline([*fields, Field("labels", "int32")], sample=sample, name=f"fixed supply ({sample_s:g} s per sample)")
