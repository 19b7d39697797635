"""The words the supervisor and its workers use for where a process is in its life.

Workers report their phase over the heartbeat pipe; `crawld status` prints it. StrEnum
members are plain strings on the wire (JSON) and compare equal to them.
"""
from __future__ import annotations

import enum


class Phase(enum.StrEnum):
    """A worker's phase, as it reports it in every heartbeat."""

    STARTING = "starting"
    CONNECTING = "connecting"
    RUNNING = "running"
    DRAINING = "draining"
    PAUSED = "paused"           # a fault of its own (disk, store, network): probing, not consuming
    STOPPED = "stopped"
    RETIRING = "retiring"       # supervisor's view: running, but being replaced (HUP, TTOU)


class StopMode(enum.StrEnum):
    """How the supervisor was asked to stop."""

    NONE = ""
    GRACEFUL = "graceful"       # TERM/INT: drain every worker
    FAST = "fast"               # QUIT, or a second INT during a drain
