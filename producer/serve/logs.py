"""Log set-up shared by the CLI and producer workers: one line per event, text or JSON; and ``counted``, for
the counts in lines people read.

text: ``2026-01-01 12:00:00,000 INFO stoker.producer: images_per_s=812.3 ...``
json: ``{"ts": "...", "level": "INFO", "logger": "stoker.producer", "msg": "...", "images_per_s": 812.3}``
key=value pairs in a message are also lifted into JSON fields, so both formats carry
the same data.
"""

from __future__ import annotations

import json
import logging
import re
import sys

LOG_FORMATS = ("text", "json")
_KV_RE = re.compile(r"\b([a-z_][a-z0-9_]*)=(\S+)")


class JsonLogFormatter(logging.Formatter):
    """Formats a record as one JSON object on one line."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        event = {"ts": self.formatTime(record), "level": record.levelname, "logger": record.name, "msg": message}
        for key, value in _KV_RE.findall(message):
            try:
                event.setdefault(key, float(value) if "." in value else int(value))
            except ValueError:
                event.setdefault(key, value)
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return json.dumps(event)


def configure_logging(level: int = logging.INFO, fmt: str = "text") -> None:
    """Install one stderr handler on the root logger in format ``fmt`` (text or json)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if fmt == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def counted(n: int, noun: str, plural: str = "") -> str:
    """``1 worker``, ``2 workers``: a count with its noun, for lines people read (``plural`` where not noun + s)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
