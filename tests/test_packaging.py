"""The distribution installs only under `stoker`, and the producer side needs no TensorFlow."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_wheel_installs_into_a_fresh_venv_and_imports_as_stoker(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(ROOT)], check=True, timeout=240)
    wheel = next(dist.glob("stoker-*.whl"))
    top_level = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    version = wheel.name.split("-")[1]
    assert top_level == {"stoker", f"stoker-{version}.dist-info"}, top_level
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, timeout=120)
    # Dependencies come from this environment's site-packages, appended *after* the venv's own,
    # without processing .pth files, so the source tree's editable install cannot shadow the wheel.
    deps = sysconfig.get_paths()["purelib"]
    probe = (
        "import sys; sys.path.append(%r)\n"
        "import stoker.protocol, stoker.producer.serve.daemon\n"
        "print(stoker.protocol.__file__)\n"
        "for generic in ('producer', 'consumer', 'protocol', 'cli'):\n"
        "    try:\n"
        "        __import__(generic)\n"
        "    except ImportError:\n"
        "        continue\n"
        "    raise SystemExit('generic top-level module installed: ' + generic)\n"
    ) % deps
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(env_dir)), out.stdout
    console = env_dir / "bin" / "stoker"
    assert console.exists()


def test_producer_side_runs_without_tensorflow(synth_lmdb):
    # sys.modules[name] = None makes any `import tensorflow` fail, as on a data host without it.
    probe = (
        "import sys; sys.modules['tensorflow'] = None\n"
        "import stoker.protocol, stoker.producer.serve.daemon, stoker.producer.serve.worker, stoker.producer.dataset.build\n"
        "from stoker.cli.main import main\n"
        "sys.exit(main(['lmdb', 'info', %r]))\n"
    ) % str(synth_lmdb)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "records:  96" in out.stdout
