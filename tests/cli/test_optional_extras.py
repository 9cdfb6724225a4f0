"""Commands that need an extra that is not installed say so before they start, never at step 24."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

# A module missing as on a machine where it was never installed: every import of it fails.
BLOCKER = '''
import importlib.abc, sys
class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _NotInstalled())
'''


def _run(tmp_path: Path, blocked: set[str], *args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(blocked)))
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=tmp_path)


def test_demo_without_tensorboard_trains_to_the_end_with_one_warning(tmp_path):
    out = _run(tmp_path, {"tensorboard"}, "-m", "stoker.cli.main", "demo", "--steps", "30", "--records", "64",
               "--image-size", "32", "--batch-size", "8", "--cache-dir", str(tmp_path / "cache"))
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "trained 30 steps" in log and "shutdown: clean" in log
    assert log.count("TensorBoard is not installed") == 1
    assert "tensorboard --logdir" not in log


def test_train_with_logdir_but_no_tensorboard_stops_before_training_naming_the_extra(tmp_path):
    out = _run(tmp_path, {"tensorboard"}, "-m", "stoker.cli.main", "train", "--connect", "tcp://127.0.0.1:1",
               "--logdir", str(tmp_path / "runs"), "--recv-timeout", "600", "--image-size", "32", "--steps", "5")
    assert out.returncode == 2, out.stderr[-3000:]
    assert "TensorBoard is not installed" in out.stderr and "stoker[train]" in out.stderr
    assert "Traceback" not in out.stderr and "waiting for the first batches" not in out.stderr


def test_keras_callback_with_logdir_but_no_tensorboard_fails_when_made(tmp_path):
    probe = (
        "from stoker.consumer import ZMQInput\n"
        "from stoker.consumer.tf.summaries import TensorBoardNotInstalledError\n"
        "with ZMQInput(['tcp://127.0.0.1:1'], batch_size=2, image_shape=(8, 8, 3), recv_timeout=600) as inp:\n"
        "    inp.keras_callback(log_every=5)  # no logdir: fine\n"
        "    try:\n"
        "        inp.keras_callback(logdir='runs')\n"
        "    except TensorBoardNotInstalledError as exc:\n"
        "        print('refused:', exc)\n"
    )
    out = _run(tmp_path, {"tensorboard"}, "-c", probe)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: ZMQInput.keras_callback(logdir=...) writes TensorBoard summaries" in out.stdout


@pytest.mark.parametrize("command", [["train", "--connect", "tcp://127.0.0.1:1"], ["bench", "trainer"], ["demo"]])
def test_trainer_commands_without_tensorflow_name_the_extra(tmp_path, command):
    out = _run(tmp_path, {"tensorflow", "tensorboard"}, "-m", "stoker.cli.main", *command, timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "needs TensorFlow" in out.stderr and "stoker[train-cpu]" in out.stderr and "Traceback" not in out.stderr


def test_train_without_logdir_needs_no_tensorboard(tmp_path, synth_lmdb):
    from stoker.producer.process import ProducerProcess

    args = ["--workers", "1", "--batch-size", "4", "--image-size", "16"]
    with ProducerProcess(synth_lmdb, extra_args=args) as producer:
        out = _run(tmp_path, {"tensorboard"}, "-m", "stoker.cli.main", "train", "--connect", producer.endpoint,
                   "--steps", "60", "--log-every", "10", "--batch-size", "4", "--image-size", "16", "--classes", "4",
                   "--no-progress")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained 60 steps" in out.stdout
