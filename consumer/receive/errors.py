"""Errors the trainer side raises, and the advice they carry; each says what happened and what to check.

The advice texts are defined here once and quoted by every transport that meets the situation (the
ZMTP parser, libzmq's handshake monitor, the exact-mode links), so a fix is worded the same everywhere.
"""

from stoker.protocol.batch_spec import BatchMismatchError

#: a producer requires CurveZMQ and this trainer has no keys
ADVICE_CURVE_KEYS = ("pass curve=stoker.protocol.curve.load_client_keys(SECRET, SERVER_PUBLIC) to ZMQInput "
                     "(stoker train: --curve-secret-key and --curve-server-key)")
#: the peer hung up during the greeting: most likely CurveZMQ, perhaps not a producer at all
ADVICE_HUNG_UP = (f"most likely the producer requires CurveZMQ and this trainer has no keys: {ADVICE_CURVE_KEYS}, "
                  "or check the address is a Stoker producer")
#: the sockets cannot talk, direction unknown: one side runs exact mode and the other does not
ADVICE_MODE_MISMATCH = ("the producer closed the connection or refused its socket type: most likely one side runs "
                        "in exact mode and the other does not; start the producers with --exact (or --epochs N) "
                        "exactly when the trainer uses ZMQInput(..., exact=True) (stoker train --exact)")
#: this trainer runs exact mode, the producer plain mode
ADVICE_PRODUCER_PLAIN = ("most likely the producer runs plain mode and this trainer exact mode; start the producers "
                         "with --exact (or --epochs N), or the trainer without exact=True (stoker train without "
                         "--exact)")
#: this trainer runs plain mode, the producer exact mode
ADVICE_PRODUCER_EXACT = ("most likely the producer runs in exact mode (--exact or --epochs N) and this trainer does "
                         "not; use ZMQInput(..., exact=True) (stoker train --exact), or start the producer without "
                         "--exact")


class InputError(RuntimeError):
    """The input pipeline cannot deliver batches any more."""


class InputTimeoutError(InputError):
    """No batch arrived from any producer within ``recv_timeout`` seconds."""


class InputMismatchError(InputError):
    """Every producer that sent batches sends arrays this trainer cannot take (batch size, image size, fields).

    Waiting cannot fix it (a producer's spec does not change while it runs), so the input fails at once instead of
    after ``recv_timeout``; the message quotes the producer's spec, this trainer's, and the flag to change.
    """


class InputModeError(InputError):
    """Every producer refused the handshake again and again for a mode mismatch: one side runs exact mode (producers
    ``--exact`` or ``--epochs N``) and the other does not. Waiting cannot fix it; the message names the flag."""


class InputClosedError(InputError):
    """The ZMQInput was closed (``close()``, Ctrl-C) while a step waited for data."""


class InputFinished(InputError):
    """Exact mode, a finite run: every producer finished its epochs and every record was delivered.

    Not a failure: ``as_dataset()`` simply ends; a step inside ``tf.function`` sees TensorFlow's
    own ``tf.errors.OutOfRangeError``; an eager ``get()`` raises this.
    """


__all__ = ["BatchMismatchError", "InputClosedError", "InputError", "InputFinished", "InputMismatchError",
           "InputModeError", "InputTimeoutError"]
