"""Errors the trainer side raises; each says what happened and what to check."""

from stoker.protocol.batch_spec import BatchMismatchError


class InputError(RuntimeError):
    """The input pipeline cannot deliver batches any more."""


class InputTimeoutError(InputError):
    """No batch arrived from any producer within ``recv_timeout`` seconds."""


class InputClosedError(InputError):
    """The ZMQInput was closed (``close()``, Ctrl-C) while a step waited for data."""


__all__ = ["BatchMismatchError", "InputClosedError", "InputError", "InputTimeoutError"]
