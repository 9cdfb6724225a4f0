"""PyTorch DDP from a Stoker pool: exact epochs, input checkpointed with the model, resumed on any number of ranks.

Each rank of a ``torchrun`` job reads its own share of an elastic producer pool through ``TorchInput`` (share from
the process group; batches received into pinned memory and copied to its GPU behind the step) and trains a
``DistributedDataParallel`` model. Every ``--checkpoint-every`` steps the model, the optimizer, the step and the
input go into one ``torch.distributed.checkpoint``; the input's part is the *job state* (every rank's records), so
the job may be restarted with another ``--nproc-per-node`` and each record of the open epoch still comes once.

    # producers on data hosts: stoker produce --lmdb train.lmdb --shard auto --exact --bind tcp://*:5555
    torchrun --nproc-per-node 8 examples/torch_ddp.py --connect tcp://stoker-producers:5555 \\
             --model resnet50 --ckpt-dir /ckpt/run1 --checkpoint-every 500
    # preempted? run it again with whatever GPUs you have: it continues from the latest checkpoint
    torchrun --nproc-per-node 4 examples/torch_ddp.py --connect tcp://stoker-producers:5555 --model resnet50 ...

Run without torchrun (``python examples/torch_ddp.py``) it demonstrates itself: synthetic data, two producers,
a two-rank gloo job on this machine. ``--model`` is a torchvision model name where torchvision is installed,
or ``small`` (default), a few convolutions. gloo on CPU, nccl on GPUs. A rank whose share ran out while others
still have batches steps on a zero-weighted batch, so every rank joins every all-reduce (DDP needs that).

The model's class count is the dataset's: producers name it in every batch header, and the input's
``stats.dataset_classes`` holds it once a batch has arrived. So the input is restored and its first batch taken
before the model is built (``model_classes``); ``--classes`` overrides it (never below the dataset's).
"""

import argparse
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

CLASSES = 4


def small_model(classes: int):
    import torch.nn as nn

    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.GroupNorm(4, 32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))


def build_model(name: str, classes: int):
    if name == "small":
        return small_model(classes)
    import torchvision  # the stoker[torch] extra does not force it: CPU-only torch builds lack a matching one

    return torchvision.models.get_model(name, weights=None, num_classes=classes)


class TrainState:
    """Model, optimizer and step as one DCP ``Stateful`` (PyTorch's recommended pattern)."""

    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer, self.step = model, optimizer, 0

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.step = state["step"]


def model_classes(inp, requested, device, dist) -> int:
    """The model's class count: the dataset's, which producers name in every batch header (``inp.stats
    .dataset_classes``, known once a batch arrived; the largest over the ranks, one may have received none), or
    ``--classes``, refused below the dataset's (labels would fall outside the model)."""
    import torch

    known = torch.tensor([inp.stats.dataset_classes], device=device)
    dist.all_reduce(known, op=dist.ReduceOp.MAX)
    dataset = int(known.item())
    if requested and requested < dataset:
        raise SystemExit(f"--classes {requested} is below the {dataset} classes of the producers' dataset: pass "
                         f"--classes {dataset} or leave it out")
    if not (requested or dataset):
        raise SystemExit("the producers name no class count (a dataset without classes): pass --classes")
    return requested or dataset


def latest_checkpoint(ckpt_dir: Path):
    """The newest checkpoint whose every rank finished writing (``COMPLETE`` is written last), or None."""
    done = sorted(ckpt_dir.glob("step-*/COMPLETE")) if ckpt_dir.is_dir() else []
    return done[-1].parent if done else None


def save_checkpoint(ckpt_dir: Path, state: dict, step: int, rank: int, rows: list, dist) -> None:
    """One DCP checkpoint of ``state``; with it each rank's records consumed since the last one (``rows``)."""
    import json

    import torch.distributed.checkpoint as dcp

    path = ckpt_dir / f"step-{step:08d}"
    if rank == 0 and path.exists():
        shutil.rmtree(path)  # an unfinished one from a preempted run
    dist.barrier()
    dcp.save(state, checkpoint_id=str(path))
    (path / f"rows-rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    if rank == 0:
        (path / "COMPLETE").write_text(str(step))


def die_with_launcher() -> None:
    """Linux: this rank gets SIGKILL when torchrun, its parent, goes (torchrun starts each rank in a session of its
    own, so a rank left behind by a killed or crashed launcher would otherwise run on for ever)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the launcher was already gone
            os._exit(1)


def preempt() -> None:
    """SIGKILL the whole job at once, as a preempted node pool would: torchrun and every rank it started (each in a
    session of its own; Linux's /proc lists them), then this rank. Nothing is saved after the last checkpoint."""
    agent = os.getppid()
    tasks = Path(f"/proc/{agent}/task")
    ranks = {int(pid) for task in tasks.iterdir() for pid in (task / "children").read_text().split()}
    for pid in [agent, *sorted(ranks - {os.getpid()}), os.getpid()]:
        os.kill(pid, signal.SIGKILL)


def train(args: argparse.Namespace) -> None:
    import json

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.nn.parallel import DistributedDataParallel

    from stoker.consumer import TorchInput

    die_with_launcher()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    ckpt_dir, rows = Path(args.ckpt_dir), []
    with TorchInput(args.connect.split(","), exact=True, device=device, channels_last=True,
                    dtypes={"images": torch.float32}, recv_timeout=args.recv_timeout) as inp:
        resume = latest_checkpoint(ckpt_dir)
        if resume is not None:  # the input first, before its first batch: the producers resume from it
            dcp.load({"input": inp}, checkpoint_id=str(resume))
        batches, loss = iter(inp), torch.zeros((), device=device)
        first = next(batches, None)  # its header names the dataset's class count, which the model needs
        batches = itertools.chain([first] if first is not None else [], batches)
        classes = model_classes(inp, args.classes, device, dist)
        model = build_model(args.model, classes).to(device, memory_format=torch.channels_last)
        ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        train_state = TrainState(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9))
        state = {"train": train_state, "input": inp}
        if resume is not None:
            dcp.load({"train": train_state}, checkpoint_id=str(resume))
        if rank == 0:
            source = "--classes" if args.classes else "the producers' dataset's"
            resumed = f"; resumed from {resume.name} on {world} rank(s)" if resume is not None else ""
            print(f"model of {classes} classes ({source}){resumed}", flush=True)
        images_shape = next(a.shape for a in inp.spec.arrays if a.name == "images")
        while train_state.step < args.steps:
            batch = next(batches, None)
            have = torch.tensor([batch is not None], dtype=torch.int32, device=device)
            dist.all_reduce(have, op=dist.ReduceOp.MAX)
            if not have.item():
                break  # every rank's share is done: the producers' epochs are over
            if batch is None:  # this rank's share ran out first: a zero-weighted step keeps the all-reduce whole
                weight = 0.0
                batch = {"images": torch.zeros((1, images_shape[3], *images_shape[1:3]), device=device),
                         "labels": torch.zeros(1, dtype=torch.int32, device=device)}
            else:
                weight = 1.0
                rows += list(zip(batch["epoch"].tolist(), batch["index"].tolist()))
            logits = ddp(batch["images"] / 127.5 - 1)
            loss = torch.nn.functional.cross_entropy(logits, batch["labels"].long()) * weight
            train_state.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            train_state.optimizer.step()
            train_state.step += 1
            if args.checkpoint_every and train_state.step % args.checkpoint_every == 0:
                save_checkpoint(ckpt_dir, state, train_state.step, rank, rows, dist)
                rows = []
            if train_state.step == args.preempt_at_step and rank == 0:
                preempt()
        if args.rows_log:
            Path(args.rows_log, f"final-rank{rank}.json").write_text(json.dumps(rows))
    dist.all_reduce(loss)
    if rank == 0:
        print(f"step {train_state.step}, final loss {loss.item() / world:.4f}", flush=True)
    dist.barrier()
    # Everything is saved and every rank is here: end without running destructors. Tearing down DDP's reducer
    # and a gloo ProcessGroup at exit can deadlock in PyTorch (~ProcessGroupGloo joins its worker thread while
    # holding the GIL, and that thread waits for the GIL to free a tensor): seen here, a rank left hanging.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def demo(args: argparse.Namespace) -> None:
    """Without torchrun: synthetic data, two pool producers, a two-rank job of this script, all on this machine."""
    from stoker.producer.dataset.build.synthetic import build_synthetic
    from stoker.producer.process import ProducerProcess

    with tempfile.TemporaryDirectory(prefix="stoker-example-") as tmp:
        build_synthetic(Path(tmp) / "ds", args.records, seed=1, num_classes=CLASSES, progress=False)
        flags = ["--workers", "1", "--batch-size", "8", "--image-size", "32", "--shard", "auto", "--seed", "1"]
        producers = [ProducerProcess(Path(tmp) / "ds", extra_args=flags) for _ in range(2)]
        try:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       __file__, "--connect",
                       ",".join(p.endpoint for p in producers), "--steps", str(args.steps), "--ckpt-dir",
                       str(Path(tmp) / "ckpt"), "--checkpoint-every", str(max(1, args.steps // 2))]
            subprocess.run(command, check=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
        finally:
            for producer in producers:
                producer.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connect", help="producer addresses, comma-separated (none: run the local demo)")
    parser.add_argument("--model", default="small", help="'small', or a torchvision model name (e.g. resnet50)")
    parser.add_argument("--classes", type=int, default=None,
                        help="classes of the model (default: the dataset's, which the producers name in every batch)")
    parser.add_argument("--steps", type=int, default=200, help="training steps (the job's, across restarts)")
    parser.add_argument("--ckpt-dir", default="ckpt", help="checkpoints: resumed from the newest complete one")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (0: none)")
    parser.add_argument("--recv-timeout", type=float, default=60.0, help="seconds without a batch before failing")
    parser.add_argument("--records", type=int, default=96, help="the local demo's synthetic images")
    parser.add_argument("--preempt-at-step", type=int, default=0,
                        help="testing: SIGKILL the whole job (torchrun and every rank) after this step, as a preemption")
    parser.add_argument("--rows-log", help="testing: a folder for each rank's records consumed after its last "
                        "checkpoint (those up to it are in the checkpoint folders)")
    args = parser.parse_args()
    if args.connect:
        train(args)
    else:
        demo(args)


if __name__ == "__main__":
    main()
