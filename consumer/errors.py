"""Errors the trainer side raises; each says what happened and what to check."""

from stoker.protocol import ProtocolError


class InputError(RuntimeError):
    """The input pipeline cannot deliver batches any more."""


class InputTimeoutError(InputError):
    """No batch arrived from any producer within ``recv_timeout`` seconds."""


class InputClosedError(InputError):
    """The ZMQInput was closed (``close()``, Ctrl-C) while a step waited for data."""


class BatchMismatchError(ProtocolError):
    """A well-formed batch whose arrays do not match what the trainer declared."""
