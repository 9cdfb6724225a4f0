"""PyTorch Lightning: a ``LightningDataModule`` over ``TorchInput``, its exact-mode state in Lightning's checkpoints.

``StokerDataModule.train_dataloader()`` returns the ``TorchInput`` itself (an iterable of dicts of tensors;
Lightning needs no DataLoader), and the data module's ``state_dict()`` / ``load_state_dict()`` carry the
input's state, so ``Trainer.fit(ckpt_path=...)`` resumes the epoch where the checkpoint was: the records the
model trained on since then are served again, the others are not. Lightning's fit loop takes the next batch
before the current step ends, so a checkpoint would count that batch as trained: the input runs with
``consumed_when="marked"`` and the ``MarkConsumed`` callback marks each batch as its step starts. Under DDP (``Trainer(strategy="ddp")``)
each rank's input takes its share of an elastic pool from ``torch.distributed`` and ``state_dict()`` is the
job's (every rank calls it when Lightning checkpoints), so a job resumes on any number of GPUs.

Run without arguments it demonstrates itself: synthetic data, one exact producer, a fit of half the steps
with a checkpoint, then a new Trainer resumed from it for the rest; it prints how often each record of each
finished epoch was trained on (once). Needs ``pip install lightning``.
"""

import argparse
import tempfile
from collections import Counter
from pathlib import Path

import lightning as L
import torch
import torch.nn as nn

from stoker.consumer import TorchInput

CLASSES = 4


class StokerDataModule(L.LightningDataModule):
    """Batches from Stoker producers, exact epochs, the input's state in Lightning's checkpoints."""

    def __init__(self, addresses: list[str], **input_args) -> None:
        super().__init__()
        self.addresses, self.input_args = addresses, input_args
        self.input = None
        self._resume = None  # a checkpoint's state, loaded before the input starts

    def train_dataloader(self) -> TorchInput:
        device = self.trainer.strategy.root_device if self.trainer is not None else "cpu"
        self.input = TorchInput(self.addresses, exact=True, device=device, consumed_when="marked", **self.input_args)
        if self._resume is not None:
            self.input.load_state_dict(self._resume)
        return self.input

    def state_dict(self) -> dict:
        return self.input.state_dict() if self.input is not None else (self._resume or {})

    def load_state_dict(self, state: dict) -> None:
        self._resume = state or None

    def teardown(self, stage: str) -> None:
        if self.input is not None:
            self.input.close()
            self.input = None


class MarkConsumed(L.Callback):
    """A batch's records are consumed when its step starts, not when Lightning fetched it ahead."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        trainer.datamodule.input.mark_consumed()


class Classifier(L.LightningModule):
    """``classes``: the dataset's class count. Lightning builds the model before its data loader, so this demo passes
    the count its own data has; for yours, ``stoker lmdb info DATASET`` lists it, and the producers name it in every
    batch header (``TorchInput.stats.dataset_classes`` once a batch arrived)."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(16, classes))
        self.seen: list[tuple[int, int]] = []  # (epoch, record) of every row trained on, for the demo's check

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen += list(zip(batch["epoch"].tolist(), batch["index"].tolist()))
        loss = nn.functional.cross_entropy(self.net(batch["images"].float() / 127.5 - 1), batch["labels"].long())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(addresses: list[str], steps: int, ckpt_dir: Path, resume: Path | None) -> tuple[Classifier, float]:
    model = Classifier(CLASSES)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=steps, save_last=False)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=[checkpoints, MarkConsumed()], logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    data = StokerDataModule(addresses, channels_last=True, recv_timeout=60)
    trainer.fit(model, datamodule=data, ckpt_path=str(resume) if resume else None)
    return model, float(trainer.callback_metrics["loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24, help="training steps, half before the checkpoint")
    parser.add_argument("--records", type=int, default=64, help="synthetic images")
    args = parser.parse_args()

    from stoker.producer.dataset.build.synthetic import build_synthetic
    from stoker.producer.process import ProducerProcess

    with tempfile.TemporaryDirectory(prefix="stoker-example-") as tmp:
        build_synthetic(Path(tmp) / "ds", args.records, seed=1, num_classes=CLASSES, progress=False)
        flags = ["--workers", "1", "--batch-size", "8", "--image-size", "32", "--exact", "--seed", "1"]
        with ProducerProcess(Path(tmp) / "ds", extra_args=flags) as producer:
            half = args.steps // 2
            first, _ = fit([producer.endpoint], half, Path(tmp) / "ckpt", None)
            (ckpt,) = (Path(tmp) / "ckpt").glob("*.ckpt")
            second, loss = fit([producer.endpoint], args.steps, Path(tmp) / "ckpt2", ckpt)
    counts = Counter(first.seen + second.seen)
    finished = sorted({e for e, _ in counts})[:-1]  # the last epoch may be open when the steps run out
    per_record = {n for (e, _), n in counts.items() if e in finished}
    print(f"epochs {finished} finished across the resume; times each record of them was trained on: "
          f"{sorted(per_record)}; records per epoch: {[sum(1 for k in counts if k[0] == e) for e in finished]}")
    print(f"final loss {loss:.4f}")


if __name__ == "__main__":
    main()
