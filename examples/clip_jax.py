"""JAX: a small CLIP-style contrastive training fed by Stoker's built-in ``image_text`` pipeline.

Each record holds an image and its caption (a ``str`` field). The producers send the image through
random-resized-crop and flip, and the caption as its UTF-8 bytes padded to ``text_length`` with a
``texts_len`` count; ``BatchStream`` hands them over as NumPy arrays. A tiny image encoder and a tiny
byte-level text encoder are trained with the symmetric InfoNCE loss of CLIP (Adam written out, so
nothing beyond JAX is needed). On data hosts:

    stoker produce --lmdb captions.lmdb --pipeline image_text --pipeline-arg text_length=77 --workers 16

With ``--pipeline-arg tokenizer=my_module:tokenize`` the captions arrive as int32 token ids instead.
Needs ``pip install "jax[cpu]"`` (or a CUDA build of JAX).
"""

import argparse
import math
import tempfile
from pathlib import Path

SIZE, TEXT_LENGTH, WIDTH, POOL = 32, 48, 32, 4
COLOURS, SHAPES = ("red", "lime", "cyan", "violet"), ("squares", "ellipses")


def captioned_records(count: int, seed: int = 0):
    """Synthetic images of four colours of squares or ellipses, each with a caption that says which."""
    from stoker.producer.dataset.build.synthetic import synthetic_jpeg

    for index in range(count):
        image, label = synthetic_jpeg(seed, index, len(COLOURS))
        opening = ("a photo of", "a picture of", "some")[index % 3]
        yield {"image": image, "text": f"{opening} {COLOURS[label]} {SHAPES[label % 2]}", "label": label}


def init_params(key):
    import jax

    pixels = (SIZE // POOL) ** 2 * 3
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {"image_1": jax.random.normal(k1, (pixels, 64)) / math.sqrt(pixels),
            "image_2": jax.random.normal(k2, (64, WIDTH)) / 8.0,
            "bytes": jax.random.normal(k3, (256, WIDTH)),  # one vector per byte value (a tokenizer's vocabulary)
            "text": jax.random.normal(k4, (WIDTH, WIDTH)) / math.sqrt(WIDTH),
            "log_scale": jax.numpy.asarray(math.log(1 / 0.07))}


def clip_loss(params, images, texts, lengths):
    """CLIP's symmetric InfoNCE over a batch: row i's caption is image i's, both ways round."""
    import jax
    import jax.numpy as jnp

    b = images.shape[0]
    x = images.astype(jnp.float32).reshape(b, SIZE // POOL, POOL, SIZE // POOL, POOL, 3).mean((2, 4)) / 255.0
    image = jax.nn.relu(x.reshape(b, -1) @ params["image_1"]) @ params["image_2"]
    valid = (jnp.arange(texts.shape[1]) < lengths[:, None]).astype(jnp.float32)  # the padding after texts_len
    pooled = (params["bytes"][texts] * valid[..., None]).sum(1) / jnp.maximum(valid.sum(1, keepdims=True), 1)
    text = jax.nn.relu(pooled) @ params["text"]
    image = image / jnp.linalg.norm(image, axis=1, keepdims=True)
    text = text / jnp.linalg.norm(text, axis=1, keepdims=True)
    logits = jnp.exp(params["log_scale"]) * image @ text.T
    diagonal = jnp.arange(b)
    return -(jax.nn.log_softmax(logits, 1)[diagonal, diagonal].mean()
             + jax.nn.log_softmax(logits, 0)[diagonal, diagonal].mean()) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--records", type=int, default=96, help="synthetic captioned images")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from stoker.consumer import BatchStream
    from stoker.producer.dataset.build.write_records import write_lmdb
    from stoker.producer.process import ProducerProcess

    @jax.jit
    def step(params, moments, t, batch):  # Adam, lr 3e-3
        loss, grads = jax.value_and_grad(clip_loss)(params, batch["images"], batch["texts"], batch["texts_len"])
        m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, moments[0], grads)
        v = jax.tree_util.tree_map(lambda v, g: 0.999 * v + 0.001 * g * g, moments[1], grads)
        update = lambda p, m, v: p - 3e-3 * (m / (1 - 0.9**t)) / (jnp.sqrt(v / (1 - 0.999**t)) + 1e-8)
        return jax.tree_util.tree_map(update, params, m, v), (m, v), loss

    scratch = tempfile.TemporaryDirectory(prefix="stoker-example-")  # removed at exit
    data = Path(scratch.name) / "captions"
    write_lmdb(data, captioned_records(args.records), classes=list(COLOURS), progress=False)
    producer_args = ["--workers", "1", "--batch-size", "16", "--image-size", str(SIZE), "--seed", "1",
                     "--pipeline", "image_text", "--pipeline-arg", f"text_length={TEXT_LENGTH}",
                     "--pipeline-arg", "scale=0.4,1"]
    params = init_params(jax.random.PRNGKey(0))
    moments = (jax.tree_util.tree_map(jnp.zeros_like, params), jax.tree_util.tree_map(jnp.zeros_like, params))
    losses = []
    with ProducerProcess(data, extra_args=producer_args) as producer, BatchStream([producer.endpoint]) as stream:
        for t, batch in zip(range(1, args.steps + 1), stream):
            if t == 1:
                first = bytes(batch["texts"][0, :batch["texts_len"][0]]).decode()
                print(f"a batch of {len(batch['texts'])} images and captions, the first: {first!r}")
            arrays = jax.device_put({name: batch[name] for name in ("images", "texts", "texts_len")})
            params, moments, loss = step(params, moments, t, arrays)
            losses.append(float(loss))
        print(f"{len(losses)} steps on {jax.devices()[0].platform}, {stream.stats.batches} batches received")
    early, late = (sum(part) / len(part) for part in (losses[:3], losses[-3:]))
    print(f"loss over the first 3 steps {early:.3f}, the last 3 {late:.3f}; final loss {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
