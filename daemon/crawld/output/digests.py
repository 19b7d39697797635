"""Digests of small bodies computed without giving up the GIL.

CPython's hashlib gives up the GIL for any update of ``HASHLIB_GIL_MINSIZE`` (2048) bytes
or more. For a page of a few KB the hash takes a few microseconds, and with the pool's
threads waiting for the GIL, getting it back costs more than that: measured with 16
threads, a sha256 and a sha1 of 2.6 KB cost 26 us of CPU in one update each, 10 us fed
in updates below the threshold. Above ``HELD_MAX`` the hash is long enough that another
thread's work beside it is worth the hand-back: one update, the GIL given up.
"""
from __future__ import annotations

from typing import Any, Callable

HASHLIB_GIL_MINSIZE = 2048      # CPython's _hashopenssl.c: updates this large release the GIL
STEP = HASHLIB_GIL_MINSIZE - 1
HELD_MAX = 16 * 1024


def hashed(new: Callable[[], Any], *parts: bytes) -> Any:
    """``new()`` updated with ``parts`` in order (e.g. ``hashed(hashlib.sha1, head, body)``)."""
    digest = new()
    held = sum(map(len, parts)) <= HELD_MAX
    for part in parts:
        if not held or len(part) < HASHLIB_GIL_MINSIZE:
            digest.update(part)
            continue
        view = memoryview(part)
        for start in range(0, len(view), STEP):
            digest.update(view[start:start + STEP])
    return digest
