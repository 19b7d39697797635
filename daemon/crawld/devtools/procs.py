"""Process inspection from /proc, for the servers `crawld demo` starts and stops.

A RabbitMQ node is a tree of processes (the Debian wrapper, ``su``, beam.smp, its
port programs and epmd); some of them outlive their parent, so stopping a node means
finding every process that carries the node's marker in its environment or argv.
"""
from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    name: str
    state: str
    cmdline: str


def _parse_stat(stat: str) -> tuple[str, str, int]:
    """(name, state, ppid) from "pid (comm) state ppid ..."; comm may hold spaces and ')'."""
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
    return name, state, int(ppid)


def read_proc(pid: int) -> tuple[ProcInfo, bytes] | None:
    """``pid``'s ProcInfo and raw environment, or None if it is gone."""
    base = f"/proc/{pid}"
    try:
        with open(f"{base}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
        with open(f"{base}/cmdline", "rb") as fh:
            cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        try:
            with open(f"{base}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:
            environ = b""
    except OSError:
        return None  # gone meanwhile
    name, state, ppid = _parse_stat(stat)
    return ProcInfo(pid, ppid, name, state, cmdline), environ


def children_of(pid: int) -> list[int]:
    """Live (non-zombie) child pids of ``pid``, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                _name, state, ppid = _parse_stat(fh.read())
        except OSError:
            continue
        if ppid == pid and state != "Z":
            out.append(int(entry))
    return sorted(out)


def _list_processes() -> list[tuple[ProcInfo, bytes]]:
    """Every process with its raw environment (readable for all processes when root)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = read_proc(int(entry))
            if info is not None:
                found.append(info)
    return found


def leftover_processes(pattern: str, names: tuple[str, ...] = ()) -> list[ProcInfo]:
    """Live processes whose command line or environment contains ``pattern``, plus all
    their descendants (PostgreSQL children rewrite their argv, so only the tree finds them).

    Zombies are ignored: PID 1 in this VM does not reap orphans, and a zombie holds no
    port, file or memory. ``names`` optionally keeps only those process names.
    """
    procs = _list_processes()
    needle = pattern.encode()
    me = os.getpid()
    matched = {
        info.pid for info, env in procs
        if info.pid != me and (pattern in info.cmdline or needle in env)
    }
    children: dict[int, list[int]] = {}
    for info, _ in procs:
        children.setdefault(info.ppid, []).append(info.pid)
    stack = list(matched)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in matched and child != me:
                matched.add(child)
                stack.append(child)
    return [
        info for info, _ in procs
        if info.pid in matched and info.state != "Z" and (not names or info.name in names)
    ]


def kill_pid(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal ``pid``; one that is already gone (or not ours) is not an error here."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def kill_leftovers(pattern: str) -> None:
    for info in leftover_processes(pattern):
        kill_pid(info.pid)
