"""``stoker state``: read and merge exact-mode input states saved as files (``save_state()``'s bytes).

``stoker state info FILE`` says whose state it is and how far each stream got; ``stoker state merge RANK_FILES...
--output JOB_FILE`` writes the job state of a job's ranks (``stoker.consumer.merge_states``), which every rank of
a job of any size continues from (``resume_state=``, ``restore_state()``, ``TorchInput.load_state_dict``). Only ``save_state()``
bytes are read: a framework checkpoint (TensorFlow's, ``torch.save``) is the framework's to open.
"""

from __future__ import annotations

import argparse
import os
from stoker.cli.argument_parser import HelpFormatter

MAX_FILE_BYTES = 256 * 1024 * 1024  # as an input state's own bound


def add_state_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", common: argparse.ArgumentParser) -> None:
    """``stoker state info`` and ``stoker state merge``."""
    state = sub.add_parser("state", parents=[common], formatter_class=HelpFormatter,
                           help="inspect and merge exact-mode input states",
                           description="Exact-mode input states are the bytes save_state() returns (write them to "
                           "a file). A job of several trainers saves one per rank; merge them to resume the job on "
                           "any number of trainers, each record of the open epochs served once.")
    ssub = state.add_subparsers(dest="state_command", required=True, metavar="ACTION")
    info = ssub.add_parser("info", parents=[common], formatter_class=HelpFormatter, help="describe a state file",
                           description="The trainer id(s), share and, per stream, the completed epochs and the "
                           "records consumed in each open one.")
    info.add_argument("file", help="a file holding save_state()'s bytes")
    info.set_defaults(func=cmd_state_info)
    merge = ssub.add_parser(
        "merge", parents=[common], formatter_class=HelpFormatter, help="merge a job's ranks' states into one",
        description="Merge the states of every rank of one job, saved at the same step, into a job state. Give the "
        "job state to each rank of the new job, whatever its size: a rank takes the id of the old rank of its number "
        "(a new rank gets a new id), and together the new ranks serve every record the old ones left exactly once. "
        "A fixed-shard job resumes on at least as many trainers as it had (an elastic pool on any number).")
    merge.add_argument("files", nargs="+", help="the ranks' state files, in any order")
    merge.add_argument("-o", "--output", required=True, help="file to write the job state to")
    merge.set_defaults(func=cmd_state_merge)


def _read(path: str) -> bytes:
    size = os.path.getsize(path)
    if size > MAX_FILE_BYTES:
        raise ValueError(f"{path}: {size} bytes is larger than any input state ({MAX_FILE_BYTES})")
    with open(path, "rb") as f:
        return f.read()


def describe(data: bytes) -> list[str]:
    """Lines describing a state; ValueError for bytes that are not one."""
    from stoker.consumer.exact.state import parse_state

    saved = parse_state(data)
    if saved.trainers is not None:
        lines = [f"job state of {len(saved.trainers)} rank(s): {', '.join(saved.trainers)}"]
    else:
        lines = [f"trainer {saved.trainer}, rank {saved.share[0]} of {saved.share[1]}"
                 + (" (merge it with the other ranks' states to resume on another number)" if saved.share[1] > 1
                    else "")]
    for key, progress in sorted(saved.state.streams.items()):
        opened = ", ".join(f"epoch {e}: {progress.consumed_in(e)}/{progress.size}" for e in sorted(progress.open))
        split = f", split {saved.splits[key]}" if key in saved.splits else ""
        lines.append(f"  {key}{split}: {progress.completed} epoch(s) complete" + (f"; {opened}" if opened else ""))
    return lines


def cmd_state_info(args: argparse.Namespace) -> int:
    for line in describe(_read(args.file)):
        print(line)
    return 0


def cmd_state_merge(args: argparse.Namespace) -> int:
    from stoker.consumer.exact.state import merge_states

    states = []
    for path in args.files:
        try:
            states.append(_read(path))
        except FileNotFoundError:
            raise ValueError(f"{path}: no such file") from None
    try:
        job = merge_states(states)
    except ValueError as exc:
        raise ValueError(f"{exc} (files: {', '.join(args.files)})") from None
    tmp = f"{args.output}.tmp"
    with open(tmp, "wb") as f:
        f.write(job)
    os.replace(tmp, args.output)
    for line in describe(job):
        print(line)
    print(f"wrote {args.output}: give it to every rank of the new job")
    return 0
