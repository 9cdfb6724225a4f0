"""The distribution: a wheel built from the checkout, installed non-editable into a fresh venv, holds every module
of the tree under ``stoker`` only, imports each one, and serves a batch; the producer side needs no TensorFlow.

The editable install the suite runs in maps the source folders directly, so it cannot see a package the wheel
leaves out: only an installed wheel can. One wheel is built (from exactly what the Dockerfiles copy) and one venv
made, for the whole module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from stoker.producer.serve.status_file import DaemonStatus

ROOT = Path(__file__).resolve().parents[2]
TOP_FOLDERS = ("protocol", "producer", "consumer", "cli")  # installed as stoker.protocol, stoker.producer, ...
DOCKERFILES = (ROOT / "deploy" / "producer.Dockerfile", ROOT / "deploy" / "trainer.Dockerfile")
#: the environment of the installed programs: nothing that could put the checkout on their sys.path
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}


def _dockerfile_sources(dockerfile: Path) -> list[str]:
    """What a Dockerfile copies from the build context (``COPY SRC... DEST`` lines, not ``--from``)."""
    sources = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not words[1].startswith("--"):
            sources += [w.rstrip("/") for w in words[1:-1]]
    return sources


def _tree_modules() -> list[str]:
    """Every .py under the top folders of the checkout, as the file names the wheel must hold."""
    return sorted(f"stoker/{path.relative_to(ROOT)}" for top in TOP_FOLDERS for path in (ROOT / top).rglob("*.py")
                  if "__pycache__" not in path.parts)


def _module_name(wheel_path: str) -> str:
    """``stoker/consumer/exact/pool/__init__.py`` -> ``stoker.consumer.exact.pool``; ``.../x.cpython-311-...so`` -> ``x``."""
    dotted = wheel_path.split(".", 1)[0].replace("/", ".")
    return dotted.removesuffix(".__init__")


@dataclass
class Installed:
    wheel_files: list[str]
    env_dir: Path
    python: Path
    site_packages: Path
    cwd: Path  # a folder with nothing of ours in it, to run the installed programs from

    def program(self, name: str) -> str:
        return str(self.env_dir / "bin" / name)

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=self.cwd, env=CLEAN_ENV)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The wheel built from a copy of what the Dockerfiles copy (a clean tree: no stale build/ of the checkout),
    installed with ``--no-deps`` into a fresh venv whose dependencies come from this venv (a .pth line naming its
    site-packages, which adds the folder but runs none of its .pth files: this venv's editable finder stays off)."""
    sources = _dockerfile_sources(DOCKERFILES[0])
    assert sources and all(_dockerfile_sources(d) == sources for d in DOCKERFILES), "the Dockerfiles copy different files"
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    for name in sources:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    dist = base / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(dist), str(src)], check=True, timeout=240, cwd=base)
    wheel = next(dist.glob("stoker-*.whl"))
    env_dir = base / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, timeout=120, cwd=base)
    site_packages = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    # Written after the install, so pip never saw this venv's editable stoker as installed there.
    (site_packages / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    cwd = base / "elsewhere"
    cwd.mkdir()
    return Installed(sorted(zipfile.ZipFile(wheel).namelist()), env_dir, python, site_packages, cwd)


@pytest.mark.timeout(300)
def test_the_wheel_holds_every_module_of_the_tree_and_only_under_stoker(installed):
    top_level = {name.split("/")[0] for name in installed.wheel_files}
    assert top_level - {"stoker"} == {next(n for n in top_level if n.endswith(".dist-info"))}, top_level
    missing = sorted(set(_tree_modules()) - set(installed.wheel_files))
    assert not missing, f"the wheel lacks {missing}: setup.py ships every package folder (one with __init__.py)"
    if Path(sysconfig.get_paths()["include"], "Python.h").exists() and Path("/usr/include/jpeglib.h").exists():
        # CI installs the compiler and headers (.ci/run): there the optional crop-window decoder must ship.
        assert any(re.fullmatch(r"stoker/producer/images/_jpeg_crop\..*\.so", n) for n in installed.wheel_files)


@pytest.mark.timeout(300)
def test_every_module_imports_from_the_installed_wheel_and_nothing_from_the_checkout(installed):
    modules = sorted({_module_name(n) for n in installed.wheel_files
                      if n.startswith("stoker/") and n.endswith((".py", ".so"))})
    assert {"stoker.consumer.exact.pool.split_scheduler", "stoker.cli.main"} <= set(modules)
    probe = (
        "import importlib, importlib.util, json, sys\n"
        "failed = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except BaseException as exc:\n"
        "        failed[name] = f'{type(exc).__name__}: {exc}'\n"
        "generic = [n for n in ('producer', 'consumer', 'protocol', 'cli') if importlib.util.find_spec(n)]\n"
        "print(json.dumps({'failed': failed, 'generic': generic,\n"
        "                  'files': [sys.modules[n].__file__ for n in sys.argv[1:] if n in sys.modules]}))\n"
    )
    out = installed.run([str(installed.python), "-c", probe, *modules], timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["failed"] == {}, found["failed"]
    assert found["generic"] == [], f"generic top-level modules installed: {found['generic']}"
    outside = [f for f in found["files"] if not f.startswith(str(installed.site_packages))]
    assert len(found["files"]) == len(modules) and not outside, f"imported from outside the wheel: {outside[:5]}"


@pytest.mark.timeout(300)
def test_the_installed_stoker_serves_a_batch_to_batch_stream(installed, tmp_path):
    help_out = installed.run([installed.program("stoker"), "--help"], timeout=60)
    assert help_out.returncode == 0 and "produce" in help_out.stdout, help_out.stderr
    data = tmp_path / "synth"
    made = installed.run([installed.program("stoker"), "lmdb", "synth", str(data), "--count", "16", "--classes", "2",
                          "--quiet"], timeout=120)
    assert made.returncode == 0, made.stderr
    status = DaemonStatus(tmp_path / "status.jsonl")
    with open(tmp_path / "producer.log", "wb") as log:
        producer = subprocess.Popen(
            [installed.program("stoker"), "produce", "--lmdb", str(data), "--bind", "tcp://127.0.0.1:*",
             "--workers", "1", "--batch-size", "4", "--image-size", "32", "--parent-pid", str(os.getpid()),
             "--status-file", str(status.path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=installed.cwd, env=CLEAN_ENV)
    try:
        serving = _wait_for_serving(status, producer, tmp_path / "producer.log")
        probe = (
            "import json, sys, stoker.consumer\n"
            "from stoker.consumer import BatchStream\n"
            "with BatchStream([sys.argv[1]], recv_timeout=60) as stream:\n"
            "    batch = next(stream)\n"
            "print(json.dumps({'shapes': {k: list(v.shape) for k, v in batch.items()}, 'from': stoker.consumer.__file__}))\n"
        )
        out = installed.run([str(installed.python), "-c", probe, serving["endpoint"]], timeout=120)
        assert out.returncode == 0, out.stderr[-4000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["from"].startswith(str(installed.site_packages)), got["from"]
        assert got["shapes"]["images"] == [4, 32, 32, 3] and got["shapes"]["labels"] == [4], got["shapes"]
    finally:
        producer.send_signal(signal.SIGTERM)
        try:
            producer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            producer.kill()
            producer.wait(timeout=30)
        status.close()
    assert producer.returncode == 0, (tmp_path / "producer.log").read_text()[-3000:]


def _wait_for_serving(status: DaemonStatus, producer: subprocess.Popen, log: Path, timeout: float = 90.0) -> dict:
    """The daemon's "serving" status line; fails with its log if it exits or says nothing within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        exited = producer.poll() is not None
        serving = status.event("serving")
        if serving is not None:
            return serving
        if exited:
            break
        time.sleep(0.05)
    raise AssertionError(f"the installed `stoker produce` did not serve (exit {producer.poll()}): "
                         + log.read_text(errors="replace")[-3000:])


def test_producer_side_runs_without_tensorflow(synth_lmdb):
    # sys.modules[name] = None makes any `import tensorflow` fail, as on a data host without it.
    probe = (
        "import sys; sys.modules['tensorflow'] = None\n"
        "import stoker.protocol, stoker.producer.serve.daemon, stoker.producer.serve.worker, stoker.producer.dataset.build.builder\n"
        "from stoker.cli.main import main\n"
        "sys.exit(main(['lmdb', 'info', %r]))\n"
    ) % str(synth_lmdb)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "records:  96" in out.stdout
