"""TensorBoard summaries, decided before training starts and never mid-run.

TensorFlow's summary writers work without TensorBoard, but the first
``tf.summary.scalar`` raises ``TBNotInstalledError`` (TensorFlow >= 2.16 does not
install TensorBoard), so a run that asked for summaries would die at its first
logging step. Stoker checks up front, with the same import TensorFlow does:

- summaries the user asked for (``stoker train --logdir``, ``keras_callback(logdir=...)``,
  ``TrainConfig(logdir=...)``) raise TensorBoardNotInstalledError before training,
  naming the extra to install;
- summaries Stoker merely offers (``stoker demo``) are turned off with one warning.
"""

from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger("stoker.consumer")

INSTALL_HINT = "pip install 'stoker[train]' (or 'stoker[train-cpu]', or just tensorboard)"


class TensorBoardNotInstalledError(RuntimeError):
    """Summaries were asked for (a logdir) but TensorBoard is not installed; the message says what to install."""


def tensorboard_installed() -> bool:
    """Whether ``tf.summary.scalar`` can work: the module TensorFlow imports for it is importable."""
    try:
        from tensorboard.summary.v2 import scalar  # noqa: F401  (TensorFlow imports exactly this)
    except ImportError:
        return False
    return True


def require_tensorboard(logdir: Optional[str], what: str) -> None:
    """Raise TensorBoardNotInstalledError if ``logdir`` is set and TensorBoard is missing; ``what`` names the caller."""
    if logdir and not tensorboard_installed():
        raise TensorBoardNotInstalledError(
            f"{what} writes TensorBoard summaries to {logdir}, but TensorBoard is not installed: {INSTALL_HINT}, "
            "or leave the log directory unset to train without summaries")


def optional_logdir(logdir: Optional[str]) -> Optional[str]:
    """``logdir`` if TensorBoard is installed, else None after one warning (for summaries nobody asked for)."""
    if logdir and not tensorboard_installed():
        log.warning("TensorBoard is not installed, so no summaries are written (%s to get them)", INSTALL_HINT)
        return None
    return logdir
