"""Trainer side of Stoker.

``ZMQInput`` feeds TensorFlow (requires tensorflow); ``BatchStream`` yields dicts of NumPy arrays for
any framework and never imports TensorFlow; ``TorchInput`` yields dicts of ``torch.Tensor`` (requires torch,
the ``stoker[torch]`` extra) and never imports TensorFlow. Each is imported on first use, so
``from stoker.consumer import BatchStream`` works where neither TensorFlow nor PyTorch is installed.
``merge_states`` merges the exact-mode states of a job's ranks into one that any number of ranks continues.
"""

from typing import Any

from stoker.consumer.receive.errors import (BatchMismatchError, InputClosedError, InputError, InputFinished, InputMismatchError,
                                   InputTimeoutError)
from stoker.consumer.exact.state import merge_states
from stoker.consumer.receive.input_stats import InputStats

__all__ = ["BatchMismatchError", "BatchStream", "InputClosedError", "InputError", "InputFinished", "InputMismatchError",
           "InputStats", "InputTimeoutError", "TorchInput", "ZMQInput", "merge_states"]


def __getattr__(name: str) -> Any:
    if name == "ZMQInput":
        from stoker.consumer.tf.zmq_input import ZMQInput

        return ZMQInput
    if name == "BatchStream":
        from stoker.consumer.numpy.batch_stream import BatchStream

        return BatchStream
    if name == "TorchInput":
        from stoker.consumer.torch.torch_input import TorchInput

        return TorchInput
    raise AttributeError(f"module 'stoker.consumer' has no attribute {name!r}")
