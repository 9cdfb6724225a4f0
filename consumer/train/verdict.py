"""Which side limited a training run, in one sentence: judged by the trainer's queue occupancy, and by where the
producers' time went when they waited on object storage (``timeline.storage_verdict``).

``stoker train``'s summary and its HTML report say it (``TrainReport.bottleneck``); ``stoker doctor`` adds its own
measurements (``throughput.Diagnosis``).
"""

from __future__ import annotations

from typing import Mapping

from stoker.consumer.train.timeline import storage_verdict

# A queue that stays well filled means the step never waited for data; a queue near empty
# means every step waited. Between the two, both sides run at about the same speed.
INPUT_BOUND_BELOW = 0.2
TRAINING_BOUND_ABOVE = 0.6


def bottleneck_verdict(mean_occupancy: float, stage_seconds: Mapping[str, Mapping[str, float]]) -> str:
    """One sentence: input-bound, training-bound or balanced at ``mean_occupancy`` (0-1); an input-bound run whose
    producers' ``stage_seconds`` show them waiting on object storage says that instead."""
    occ = mean_occupancy
    storage = storage_verdict(stage_seconds) if occ <= TRAINING_BOUND_ABOVE else None
    if storage is not None:  # input-bound because the producers waited on object storage
        return storage
    if occ < INPUT_BOUND_BELOW:
        return (f"input-bound: the queue was nearly empty (mean occupancy {occ:.2f}), so the step waited for "
                "data; add producers or --workers, or use a cheaper augmentation")
    if occ > TRAINING_BOUND_ABOVE:
        return (f"training-bound: producers kept the queue filled (mean occupancy {occ:.2f}); the input is "
                "not the limit, the model step is")
    return (f"balanced: mean queue occupancy {occ:.2f}; input and training run at about the same speed, "
            "so more producers would help only a little")
