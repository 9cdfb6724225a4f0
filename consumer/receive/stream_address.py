"""Where direct receive connects, and the stream socket it connects with: TCP, or a Unix socket for ``ipc://``.

A producer binds ``tcp://host:port`` (a data host) or ``ipc://PATH`` (this host: libzmq's ipc transport is a Unix
stream socket carrying the same ZMTP). ``stream_address`` checks an endpoint and names the fix for one direct
receive cannot reach; ``open_stream`` makes the non-blocking socket for it; ``tune_stream`` sets a connected one up.
"""

from __future__ import annotations

import errno
import socket
from typing import Any, Optional, Union
from urllib.parse import urlsplit

#: the longest path a Unix socket address holds (``sun_path``, Linux), the terminating NUL left out
MAX_IPC_PATH = 107

StreamAddress = Union[tuple[str, int], str]
#: what a non-blocking TCP connect returns while it goes on in the background
CONNECTING = (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK)


def stream_address(endpoint: str) -> StreamAddress:
    """Where direct receive connects: ``tcp://host:port`` -> ``(host, port)``; ``ipc://PATH`` -> ``PATH`` (a Unix
    stream socket, as libzmq's ipc transport binds it; ``ipc://@name``: the abstract name). ValueError naming the
    problem for anything else."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if path.startswith("@"):
            path = "\0" + path[1:]
        if path in ("", "\0") or len(path.encode()) > MAX_IPC_PATH or "\0" in path[1:]:
            raise ValueError(f"{endpoint!r}: an ipc:// address needs a socket path of 1-{MAX_IPC_PATH} bytes, e.g. "
                             "ipc:///tmp/stoker.sock")
        return path
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(f"{endpoint!r}: direct receive speaks TCP and ipc:// only, e.g. tcp://datahost:5555")
    return parts.hostname, parts.port


def open_stream(address: StreamAddress) -> tuple[socket.socket, Any]:
    """A fresh non-blocking stream socket for ``address`` (``stream_address``) and what to ``connect`` it to (a
    TCP name is resolved here: OSError if it cannot be)."""
    if isinstance(address, str):
        sock, sockaddr = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), address
    else:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(*address, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    sock.setblocking(False)
    return sock, sockaddr


def connect_failure(sock: socket.socket, error: int, endpoint: str) -> Optional[OSError]:
    """What a non-blocking ``connect_ex`` on ``sock`` returning ``error`` means: None if connected or under way,
    else the failure to report. A Unix socket never connects in the background: EAGAIN there is the listener's
    backlog full, not progress (the socket would poll writable and look connected)."""
    unix = sock.family == socket.AF_UNIX
    if error == 0 or (not unix and error in CONNECTING):
        return None
    why = ("its socket's listen backlog is full (it accepts no more connections for now)" if unix and error == errno.EAGAIN
           else errno.errorcode.get(error, str(error)))
    return OSError(error, f"connecting to {endpoint}: {why}")


def tune_stream(sock: socket.socket) -> None:
    """A connected socket set up as libzmq sets its own: TCP without Nagle, and keepalive probes so a dead host or a
    cut link drops the connection within ~8 s (then it is connected again), not a silent half-open socket. A Unix
    socket needs neither: its peer's death closes it."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
