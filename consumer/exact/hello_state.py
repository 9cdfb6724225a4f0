"""What a trainer's hello tells one producer of its input state: the progress of the stream it serves, no more.

A producer reads nothing else of a hello's state: a fixed shard ``I/N`` looks up its own stream's key
(``FixedShardPolicy.on_hello``), and an elastic pool's producer reads none (the trainer hands it work,
``pool/pool_work``, with what it already has skipped). The whole state to every producer moved the job's
state times the producers on each trainer restart (issue 41: tens of GB at 10^9 records, 256 producers);
each stream's progress now goes once, to the producer that serves it (``benchmarks/hello_bytes.py``).

A fixed-shard producer restarted mid-epoch learns from the hello which records of its stream were consumed,
so a hello never goes before the trainer knows the producer's stream: ``knows_stream`` says when it may
(the control plane asks a producer it does not know yet to describe itself, and says hello once its status
names its stream), and ``hello_again`` says when a status calls for a new hello: from a producer that no
longer knows the trainer, or one that serves another stream than the one the hello was cut for (an address
now serving another shard); the batches of the session that hello began are then dropped (served again).
"""

from __future__ import annotations

from stoker.protocol.exact_messages import Status
from stoker.protocol.input_state import InputState, StreamKey

from stoker.consumer.exact.producers import KnownProducer

__all__ = ["hello_state", "knows_stream", "hello_again", "serves_another_stream"]


def hello_state(state: InputState, stream: str) -> InputState:
    """The input state a hello to a producer serving ``stream`` carries, copied (the ledger goes on marking
    ``state``; call under its lock): a fixed shard's progress alone (none if this trainer has none of it: the
    producer then begins the shard as the whole state lacking it made it do); nothing for an elastic pool (its
    producers read no state); the whole state for ``""``, a producer whose status names no stream, so that
    whatever it serves finds its progress. Costs what that stream's progress costs, not the job's state."""
    if not stream:
        return state.copy()
    if StreamKey.names_pool(stream) or stream not in state.streams:
        return InputState()
    return InputState({stream: state.streams[stream]}).copy()


def knows_stream(producer: KnownProducer) -> bool:
    """Whether a hello to ``producer`` can carry its stream's progress: its stream is known (from a status or a
    batch, of this connection or an earlier one), or a status came that names none (then the hello carries the
    whole state). False: ask it to describe itself first."""
    return bool(producer.stream) or producer.status is not None


def hello_again(producer: KnownProducer, status: Status) -> str:
    """Why ``status`` from ``producer`` calls for a new hello (with its stream's progress), or "" if it does not:
    a stranger answers credit or work of ours with "who are you" (it dropped the trainer, silent past its
    --trainer-timeout, or restarted unseen), and nothing would come from it for ever; a status of the current
    session that names another stream than the one its hello carried comes from a producer told nothing of what
    it serves, which would serve consumed records again. Asked of an active trainer's statuses, before one updates
    ``producer.stream``."""
    if not producer.session:
        return ""  # no hello yet: the first says what it must
    if status.stranger:
        return "no longer knows this trainer"
    if status.session == producer.session and status.stream and producer.stream and status.stream != producer.stream:
        return f"serves {status.stream}, not {producer.stream} as its hello assumed"
    return ""


def serves_another_stream(producer: KnownProducer, stream: str) -> bool:
    """Whether a batch of the current session naming fixed shard ``stream`` comes from a producer whose hello carried
    another stream's progress: it was told nothing of what it serves, and would serve consumed records again. The
    status that says so may have been lost (a producer sends it without waiting), so each batch is asked too; a
    new hello follows, and the batch is dropped (served again in the new session)."""
    return bool(producer.hello_stream and stream and stream != producer.hello_stream
                and not StreamKey.names_pool(stream))
