"""JAX: train a tiny classifier from Stoker producers, with batches prefetched onto the device.

``BatchStream`` is the receive core without TensorFlow: an iterator of dicts of NumPy arrays
that belong to the caller. ``device_prefetch`` keeps the next batches' host-to-device copies in
flight (``jax.device_put`` is asynchronous) while the current step runs, as flax's
``prefetch_to_device`` does. The model's class count is the dataset's, which producers name in every
batch header: ``stream.stats.dataset_classes``, known once the stream has learned its spec (or taken
a batch). Needs ``pip install "jax[cpu]"`` (or a CUDA build of JAX).
"""

import argparse
import collections
import tempfile
from pathlib import Path
from typing import Iterator

SIZE, CLASSES = 32, 4


def device_prefetch(batches: Iterator[dict], size: int = 2) -> Iterator[dict]:
    """Yield batches already on the default device, ``size`` transfers ahead of the consumer."""
    import jax

    queue: collections.deque = collections.deque()
    for batch in batches:
        queue.append(jax.device_put({"images": batch["images"], "labels": batch["labels"]}))
        if len(queue) > size:
            yield queue.popleft()
    while queue:
        yield queue.popleft()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    parser.add_argument("--records", type=int, default=96, help="synthetic images")
    args = parser.parse_args()

    import itertools

    import jax
    import jax.numpy as jnp

    from stoker.consumer import BatchStream
    from stoker.producer.process import ProducerProcess
    from stoker.producer.dataset.build.synthetic import build_synthetic

    def loss_fn(params, images, labels):
        x = images.astype(jnp.float32).reshape(images.shape[0], -1) / 255.0
        logits = x @ params["w"] + params["b"]
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))

    @jax.jit
    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch["images"], batch["labels"])
        return jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, params, grads), loss

    scratch = tempfile.TemporaryDirectory(prefix="stoker-example-")  # removed at exit
    data = Path(scratch.name) / "synth"
    build_synthetic(data, args.records, num_classes=CLASSES, progress=False)
    producer_args = ["--workers", "2", "--batch-size", "16", "--image-size", str(SIZE)]
    with ProducerProcess(data, extra_args=producer_args) as producer, BatchStream([producer.endpoint]) as stream:
        # The stream learned its spec from the first batch, whose header names the dataset's class count.
        classes = stream.stats.dataset_classes
        params = {"w": jnp.zeros((SIZE * SIZE * 3, classes)), "b": jnp.zeros((classes,))}
        loss = None
        for batch in itertools.islice(device_prefetch(stream), args.steps):
            params, loss = step(params, batch)
        print(f"{args.steps} steps on {jax.devices()[0].platform}, {stream.stats.batches} batches received, "
              f"receive path {stream.receive}")
    print(f"final loss {float(loss):.3f}")


if __name__ == "__main__":
    main()
