"""PyTorch: a small CLIP-style contrastive training fed by Stoker's built-in ``image_text`` pipeline.

Each record holds an image and its caption (a ``str`` field). The producers send the image through
random-resized-crop and flip, and the caption as its UTF-8 bytes padded to ``text_length`` with a
``texts_len`` count; ``TorchInput`` hands them over as tensors. A tiny image encoder and a tiny
byte-level text encoder are trained with the symmetric InfoNCE loss of CLIP: each image against every
caption of its batch. With WebDataset tars or Parquet files the producers read the captions where they
lie (``.txt`` members, a string column); on data hosts:

    stoker produce --lmdb captions.lmdb --pipeline image_text --pipeline-arg text_length=77 --workers 16

A tokenizer of your own (``--pipeline-arg tokenizer=my_module:tokenize``, a function from a caption to
token ids) makes ``texts`` int32 ids instead; the text encoder's vocabulary is then the tokenizer's.
Run this file to see it on this machine: synthetic captioned images, a producer on loopback, a few steps.
"""

import argparse
import math
import tempfile
from pathlib import Path

SIZE, TEXT_LENGTH, WIDTH = 32, 48, 32
COLOURS, SHAPES = ("red", "lime", "cyan", "violet"), ("squares", "ellipses")


def captioned_records(count: int, seed: int = 0):
    """Synthetic images of four colours of squares or ellipses, each with a caption that says which."""
    from stoker.producer.dataset.build.synthetic import synthetic_jpeg

    for index in range(count):
        image, label = synthetic_jpeg(seed, index, len(COLOURS))
        opening = ("a photo of", "a picture of", "some")[index % 3]
        yield {"image": image, "text": f"{opening} {COLOURS[label]} {SHAPES[label % 2]}", "label": label}


def make_model():
    import torch
    from torch import nn

    class TinyClip(nn.Module):
        """Two encoders into one space of ``WIDTH`` dimensions, and CLIP's learned temperature."""

        def __init__(self) -> None:
            super().__init__()
            self.image = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(),
                                       nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, WIDTH))
            self.bytes = nn.Embedding(256, WIDTH)  # one vector per byte value; a tokenizer's vocabulary otherwise
            self.text = nn.Sequential(nn.ReLU(), nn.Linear(WIDTH, WIDTH))
            self.log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

        def forward(self, images, texts, lengths):
            image = self.image(images / 255.0)
            valid = (torch.arange(texts.shape[1]) < lengths[:, None]).float()  # the padding after texts_len
            pooled = (self.bytes(texts.long()) * valid[..., None]).sum(1) / valid.sum(1, keepdim=True).clamp(min=1)
            text = self.text(pooled)
            image, text = nn.functional.normalize(image, dim=1), nn.functional.normalize(text, dim=1)
            return self.log_scale.exp() * image @ text.T  # [images, captions]

    return TinyClip()


def info_nce(logits):
    """CLIP's loss: row i's caption is image i's, both ways round."""
    import torch

    targets = torch.arange(len(logits))
    cross_entropy = torch.nn.functional.cross_entropy
    return (cross_entropy(logits, targets) + cross_entropy(logits.T, targets)) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--records", type=int, default=96, help="synthetic captioned images")
    args = parser.parse_args()

    import torch

    from stoker.consumer import TorchInput
    from stoker.producer.dataset.build.write_records import write_lmdb
    from stoker.producer.process import ProducerProcess

    torch.manual_seed(0)
    scratch = tempfile.TemporaryDirectory(prefix="stoker-example-")  # removed at exit
    data = Path(scratch.name) / "captions"
    write_lmdb(data, captioned_records(args.records), classes=list(COLOURS), progress=False)
    producer_args = ["--workers", "1", "--batch-size", "16", "--image-size", str(SIZE), "--seed", "1",
                     "--pipeline", "image_text", "--pipeline-arg", f"text_length={TEXT_LENGTH}",
                     "--pipeline-arg", "scale=0.4,1"]
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    with ProducerProcess(data, extra_args=producer_args) as producer, \
            TorchInput([producer.endpoint], channels_last=True, dtypes={"images": torch.float32}) as inp:
        for step, batch in zip(range(args.steps), inp):
            if step == 0:
                first = bytes(batch["texts"][0, :batch["texts_len"][0]].tolist()).decode()
                print(f"a batch of {len(batch['texts'])} images and captions, the first: {first!r}")
            loss = info_nce(model(batch["images"], batch["texts"], batch["texts_len"]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        print(f"{len(losses)} steps, {inp.stats.batches} batches received")
    early, late = (sum(part) / len(part) for part in (losses[:3], losses[-3:]))
    print(f"loss over the first 3 steps {early:.3f}, the last 3 {late:.3f}; final loss {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
