#!/usr/bin/env python3
"""What a PyTorch user asks first: ``torch.utils.data.DataLoader`` against Stoker producers -> ``TorchInput``.

Both run the same work on the same machine: read a record from the same LMDB, decode with random-resized-crop
(the crop window only, where the extension is built), resize, flip: the built-in ``imagenet`` pipeline's own
``fill``, with a per-record generator of (seed, epoch, index) on both sides.

- DataLoader: a map-style ``Dataset`` over the LMDB, ``num_workers`` worker processes, ``pin_memory`` where CUDA
  is available (pinned memory needs it), shuffled, ``persistent_workers``: the usual PyTorch input;
- Stoker: one producer with ``--workers`` the same number of worker processes, and ``TorchInput`` (default
  arguments: direct receive into tensors, pinned where CUDA is available) in this process.

For each, interleaved rounds (the order alternating), the median kept: images/s, and CPU seconds per batch of
the *trainer process* (for the DataLoader its workers too: they run on the trainer host; Stoker's producers run
on data hosts in a deployment, so they are reported apart). The point of disaggregation is the last column:
what preprocessing costs the trainer host. On one machine both sides share the same cores, so images/s is a
like-for-like comparison of the two input paths, not of a disaggregated deployment.
Prints a table and writes JSON (default benchmarks/results/torch_dataloader.json).
Run:  python benchmarks/torch_dataloader.py [--batches 60] [--rounds 3] [--workers 2] [--image-size 224]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from harness import (add_out_argument, benchmark_parser, launch_producer, machine_info, own_cpu_seconds,
                     pid_cpu_seconds, producer_flags, producers_cpu_now, synthetic_lmdb, write_results)


class LmdbImageNet:
    """A map-style dataset: record ``i`` of a Stoker LMDB through the ``imagenet`` pipeline's ``fill``."""

    def __init__(self, path: Path, image_size: int, seed: int = 0) -> None:
        self.path, self.image_size, self.seed = path, image_size, seed
        self._dataset = self._fill = self._rng = None
        from stoker.producer.dataset.sources import LmdbDataset

        with LmdbDataset(path) as dataset:
            self.length = len(dataset)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        import numpy as np
        import torch

        if self._dataset is None:  # opened in each worker: LMDB handles do not cross fork
            from stoker.producer.dataset.sources import LmdbDataset
            from stoker.producer.images.builtin_pipelines import make_imagenet
            from stoker.producer.serve.sharding import RecordRng

            self._dataset = LmdbDataset(self.path)
            self._fill = make_imagenet(image_size=self.image_size).fill
            self._rng = RecordRng(self.seed)
        rows = {"images": np.empty((self.image_size, self.image_size, 3), np.uint8), "labels": np.empty((), np.int32)}
        self._fill(self._dataset.read(index), self._rng.for_record(0, index), rows)
        return torch.from_numpy(rows["images"]), torch.from_numpy(rows["labels"])


def dataloader_round(path: Path, args) -> tuple[float, float]:
    """(images/s, trainer CPU s per batch: this process and its loader workers) of one DataLoader pass."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    dataset = LmdbImageNet(path, args.image_size)
    shuffled = RandomSampler(dataset, num_samples=(args.warmup + args.batches) * args.batch_size)  # epochs in a row
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=shuffled, num_workers=args.workers,
                        pin_memory=torch.cuda.is_available(), persistent_workers=True, drop_last=True)
    batches, images = iter(loader), 0
    try:
        for _ in range(args.warmup):
            next(batches)
        workers = [w.pid for w in batches._workers]  # type: ignore[attr-defined]
        t0, c0 = time.perf_counter(), own_cpu_seconds() + sum(map(pid_cpu_seconds, workers))
        for _ in range(args.batches):
            images += len(next(batches)[1])
        seconds = time.perf_counter() - t0
        cpu = own_cpu_seconds() + sum(map(pid_cpu_seconds, workers)) - c0
    finally:
        batches._shutdown_workers()  # type: ignore[attr-defined]
    return images / seconds, cpu / args.batches


def stoker_round(path: Path, args) -> tuple[float, float, float]:
    """(images/s, trainer CPU s per batch, producer CPU s per batch) of one TorchInput pass, from a producer started
    for it (one left running would decode during the DataLoader's round, taking its cores and banking batches)."""
    from stoker.consumer import TorchInput

    flags = producer_flags(args.batch_size, args.image_size, workers=args.workers, seed=0)
    with launch_producer(path, flags) as producer, TorchInput(
            [producer.endpoint], batch_size=args.batch_size, image_shape=(args.image_size, args.image_size, 3),
            recv_timeout=120) as inp:
        batches, images = iter(inp), 0
        for _ in range(args.warmup):
            next(batches)
        t0, c0, p0 = time.perf_counter(), own_cpu_seconds(), producers_cpu_now([producer])
        for _ in range(args.batches):
            images += len(next(batches)["labels"])
        seconds, cpu = time.perf_counter() - t0, own_cpu_seconds() - c0
        producer_cpu = (producers_cpu_now([producer]) - p0).producers
    return images / seconds, cpu / args.batches, producer_cpu / args.batches


def parse_args():
    parser = benchmark_parser(__doc__)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--records", type=int, default=512, help="synthetic JPEGs (ImageNet-like sizes)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers = the producer's --workers")
    parser.add_argument("--warmup", type=int, default=16, help="batches before timing: at least what both sides "
                        "buffer (queues, prefetch, batch slots), so the timed part runs at the production rate")
    parser.add_argument("--batches", type=int, default=40, help="batches timed per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is kept")
    add_out_argument(parser, "torch_dataloader.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    rounds: dict[str, list] = {"dataloader": [], "stoker": []}
    with synthetic_lmdb(args.records) as path:
        for r in range(args.rounds):
            for side in (("dataloader", "stoker") if r % 2 == 0 else ("stoker", "dataloader")):
                rounds[side].append(dataloader_round(path, args) if side == "dataloader" else stoker_round(path, args))
    dl = [statistics.median(x[i] for x in rounds["dataloader"]) for i in range(2)]
    st = [statistics.median(x[i] for x in rounds["stoker"]) for i in range(3)]
    print(f"DataLoader(num_workers={args.workers}) vs one producer (--workers {args.workers}) -> TorchInput, "
          f"{args.batch_size} x {args.image_size} px, random-resized-crop + flip, median of {args.rounds} rounds")
    print(f"{'input':>22} | {'images/s':>8} | {'trainer CPU s/batch':>19} | {'data-host CPU s/batch':>21}")
    print(f"{'DataLoader':>22} | {dl[0]:>8.0f} | {dl[1]:>19.3f} | {'(on the trainer)':>21}")
    print(f"{'Stoker -> TorchInput':>22} | {st[0]:>8.0f} | {st[1]:>19.3f} | {st[2]:>21.3f}")
    print(f"images/s ratio (Stoker / DataLoader): {st[0] / dl[0]:.3f}; trainer CPU per batch: "
          f"{st[1] / dl[1]:.3f} of the DataLoader's")
    write_results(args.out, {"benchmark": "torch_dataloader", "batch_size": args.batch_size,
                             "image_size": args.image_size, "workers": args.workers, "batches_timed": args.batches,
                             "dataloader_images_per_s": dl[0], "dataloader_trainer_cpu_s_per_batch": dl[1],
                             "stoker_images_per_s": st[0], "stoker_trainer_cpu_s_per_batch": st[1],
                             "stoker_producer_cpu_s_per_batch": st[2], "images_per_s_ratio": st[0] / dl[0],
                             "trainer_cpu_ratio": st[1] / dl[1], "rounds": rounds, **machine_info()})


if __name__ == "__main__":
    main()
