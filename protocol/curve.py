"""CurveZMQ key files: encryption and authentication between producers and trainers.

Key pairs are pyzmq's ZPL certificate files (``NAME.key`` public,
``NAME.key_secret`` public + secret), made by ``stoker keys generate``. A producer
holds its server secret file and a directory of authorised client public keys;
a trainer holds its client secret file and the server's public key file.
Errors name the file and say how to make a correct one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth


class KeyFileError(ValueError):
    """A key file is missing or is not a CurveZMQ certificate of the expected kind."""


@dataclass(frozen=True)
class CurveServerKeys:
    """What a producer needs: its key pair and the folder of client public keys it accepts."""

    public: bytes
    secret: bytes
    authorized_clients_dir: Path


@dataclass(frozen=True)
class CurveClientKeys:
    """What a trainer needs: its key pair and the producer's public key."""

    public: bytes
    secret: bytes
    server_public: bytes


def generate_keypair(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` into ``directory``; returns their paths."""
    if not zmq.has("curve"):
        raise KeyFileError("this libzmq was built without CURVE support")
    Path(directory).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def _load(path: str | os.PathLike, need_secret: bool) -> tuple[bytes, bytes | None]:
    path = Path(path)
    if not path.is_file():
        raise KeyFileError(f"key file {path} does not exist; make one with `stoker keys generate DIR --name NAME`")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except Exception as exc:
        raise KeyFileError(f"{path} is not a CurveZMQ certificate ({exc}); make one with `stoker keys generate`") from None
    if need_secret and not secret:
        raise KeyFileError(f"{path} holds no secret key: pass the NAME.key_secret file, not NAME.key")
    return public, secret


def load_server_keys(secret_file: str | os.PathLike, authorized_clients_dir: str | os.PathLike) -> CurveServerKeys:
    public, secret = _load(secret_file, need_secret=True)
    folder = Path(authorized_clients_dir)
    if not folder.is_dir() or not any(folder.glob("*.key")):
        raise KeyFileError(f"{folder} holds no client public keys (*.key); copy each trainer's NAME.key there")
    return CurveServerKeys(public=public, secret=secret, authorized_clients_dir=folder)  # type: ignore[arg-type]


def load_client_keys(secret_file: str | os.PathLike, server_public_file: str | os.PathLike) -> CurveClientKeys:
    public, secret = _load(secret_file, need_secret=True)
    server_public, _ = _load(server_public_file, need_secret=False)
    return CurveClientKeys(public=public, secret=secret, server_public=server_public)  # type: ignore[arg-type]
