"""What a command needs that a data host may not have installed: TensorFlow for the trainer-side commands.

``stoker train``, ``bench trainer``, ``doctor`` and ``demo`` call ``quiet_tensorflow()`` before they import
anything of the trainer; ``cli/main.py`` turns ``MissingExtraError`` into exit code 2 with the extra to install.
"""

from __future__ import annotations

import os


class MissingExtraError(RuntimeError):
    """A command needs an optional dependency that is not installed; the message names the extra."""


def quiet_tensorflow() -> None:
    """Import TensorFlow (MissingExtraError naming the extra if it cannot be) with its C++ logging quieted."""
    # TensorFlow's C++ logging is set only by this variable; users can still override it.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(f"this command trains or measures a model and needs TensorFlow ({exc}): install "
                                "'stoker[train]' on a GPU host or 'stoker[train-cpu]' (data hosts need neither)") from None
