"""The worker's side of the liveness pipe to its supervisor.

One JSON status line per beat. A pipe rather than a file: gunicorn's heartbeat file
stalled on slow disks. The supervisor treats a silent pipe as a stuck main loop.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

HEARTBEAT_FD_ENV = "CRAWLD_HEARTBEAT_FD"
HEARTBEAT_EVERY_S = 1.0


class Heartbeat:
    """Rate-limited status lines to the fd the supervisor passed in HEARTBEAT_FD_ENV."""

    def __init__(self, fd: int | None, every_s: float = HEARTBEAT_EVERY_S) -> None:
        self.fd = fd
        self.every_s = every_s
        self._last = 0.0

    @classmethod
    def from_env(cls) -> "Heartbeat":
        return cls(_int_env(HEARTBEAT_FD_ENV))

    def due(self, force: bool = False) -> bool:
        """True (and the beat counted as sent) when a line should go out now."""
        now = time.monotonic()
        if self.fd is None or (not force and now - self._last < self.every_s):
            return False
        self._last = now
        return True

    def send(self, status: dict[str, Any]) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, (json.dumps(status) + "\n").encode())
        except BlockingIOError:
            pass            # supervisor is behind; the next beat will do
        except OSError:
            self.fd = None  # supervisor gone: stop writing (the loop notices via getppid)


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    try:
        return int(value) if value else None
    except ValueError:
        return None
