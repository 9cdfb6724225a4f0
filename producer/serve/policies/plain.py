"""The plain mode's policy: no record chosen, no trainer known; every batch to whichever trainer is ready.

Each worker makes its own deterministic stream (worker ``w`` of ``W`` takes every W-th record of the
shard's epoch order, ``sharding.worker_stream``) and the daemon's PUSH socket hands each made batch to
a trainer with room: the ``SlotForwarder`` alone, with nothing to decide per batch. A run never ends by
itself (``--epochs`` makes a run exact).
"""

from __future__ import annotations

from typing import Any

from stoker.producer.serve.forwarder import SlotForwarder


class PlainPolicy:
    """A ``ServingPolicy`` (serving_policy.py) that decides nothing: the plain mode's."""

    mode = "plain"

    def forwarder(self, control: Any, out: Any, layout: Any, buffers: list[Any]) -> SlotForwarder:
        return SlotForwarder(control, out, layout, buffers)

    def summary(self) -> str:
        return ""

    def trainer_counts(self) -> dict[str, int]:
        return {}  # a PUSH socket does not know its trainers
