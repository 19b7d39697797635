"""The supervisor's files: its pid file and the state file `crawld status` reads.

Both are replaced atomically (write a temp file, rename), so a reader never sees half a
file; liveness itself never touches a disk (heartbeats use pipes, see children.py).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from crawld.config import Config, runtime_dir


def state_file(cfg: Config) -> Path:
    """Where `crawld status` finds the supervisor's view of its workers."""
    key = hashlib.sha256(f"{cfg.store.url}|{cfg.queue.name}".encode()).hexdigest()[:10]
    return runtime_dir(cfg) / f"supervisor-{cfg.queue.name}-{key}.json"


def write_pid_file(path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    _replace(Path(f"{path}.tmp"), Path(path), f"{os.getpid()}\n")


def write_state(path: Path, state: dict[str, Any]) -> None:
    _replace(path.with_suffix(".tmp"), path, json.dumps(state))


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` runs: a zombie (killed, not yet reaped by its parent) does
    not; one of another user's does."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def remove_quietly(path: str | Path) -> None:
    """Remove a file that may never have been written (or was removed by an operator)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _replace(tmp: Path, path: Path, text: str) -> None:
    tmp.write_text(text)
    os.replace(tmp, path)
