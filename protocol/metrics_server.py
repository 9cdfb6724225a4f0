"""A Prometheus HTTP endpoint for one collector, shared by producers and trainers.

Each server has its own CollectorRegistry (no global state) and uses
prometheus-client's HTTP server in a daemon thread; ``close()`` stops it.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.registry import Collector


class MetricsServer:
    """Serves one collector on ``http://addr:port/metrics`` from a daemon thread until ``close()``."""

    def __init__(self, port: int, collector: Collector, addr: str = "0.0.0.0") -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        try:
            self._httpd, self._thread = start_http_server(port, addr=addr, registry=registry)
        except OSError as exc:
            raise ValueError(f"cannot serve metrics on {addr}:{port}: {exc.strerror}; pick a free --metrics-port") from None
        self.port = self._httpd.server_port

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(2.0)

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
