"""Errors the trainer side raises; each says what happened and what to check."""

from stoker.protocol.batch_spec import BatchMismatchError


class InputError(RuntimeError):
    """The input pipeline cannot deliver batches any more."""


class InputTimeoutError(InputError):
    """No batch arrived from any producer within ``recv_timeout`` seconds."""


class InputClosedError(InputError):
    """The ZMQInput was closed (``close()``, Ctrl-C) while a step waited for data."""


class InputFinished(InputError):
    """Exact mode, a finite run: every producer finished its epochs and every record was delivered.

    Not a failure: ``as_dataset()`` simply ends; a step inside ``tf.function`` sees TensorFlow's
    own ``tf.errors.OutOfRangeError``; an eager ``get()`` raises this.
    """


__all__ = ["BatchMismatchError", "InputClosedError", "InputError", "InputFinished", "InputTimeoutError"]
