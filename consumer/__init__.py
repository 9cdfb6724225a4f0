"""Trainer side of Stoker: ZMQInput feeds TensorFlow from producer daemons (requires tensorflow)."""

from .errors import BatchMismatchError, InputClosedError, InputError, InputFinished, InputTimeoutError
from .zmq_input import InputStats, ZMQInput

__all__ = ["BatchMismatchError", "InputClosedError", "InputError", "InputFinished", "InputStats", "InputTimeoutError",
           "ZMQInput"]
