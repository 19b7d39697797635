"""Is it the sites, or this host? A circuit breaker over the last fetch outcomes.

One site that stops answering is that site's problem: its tasks walk the retry tiers to
the dead letters. When most of the last ``fetch.breaker_window`` fetches of this worker
failed to reach their site at all (connect error, timeout, DNS failure other than
NXDOMAIN) and those failures are spread over at least ``fetch.breaker_min_sites``
distinct sites, it is this host's network or resolver: the failure says nothing about the
tasks, so the worker defers them (no attempt used) and pauses until a probe connects
again. Sites are origins (host and port): two services on one machine fail separately.

The defaults (20, 0.8, 3) and why: 20 outcomes is about one round of a 16-thread pool, so
a trip needs fresh evidence, not one unlucky burst; with 0.8, one fetch in five getting
through proves the network works and keeps the breaker shut; three unrelated sites all
unreachable together while nothing else answers is very unlikely to be the sites'.

With ``queue.partition`` each worker owns a few shards, so it sees only its part of the
host's sites: a worker owning two sites could never count three. The distinct sites are
therefore counted for the whole host (:class:`HostEvidence`: each worker of one run dir
writes the sites it cannot reach to a small file its siblings read), while the ratio stays
this worker's own. A task put back because its site is paused for being unreachable is
evidence too (:meth:`NetworkBreaker.note`): the site pause must not hide an outage of the
host's network from the breaker by starving it of fetches. Once one worker of the host
has paused on the network, a sibling whose own recent outcomes are mostly failures
pauses without waiting for a full window: owning one site with a few tasks left, it
would otherwise spend their attempts. A paused worker probes the sites that made the
case (its own first, then its siblings'), so one of its own sites being down for good
cannot keep it paused once the host's network is back.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterable
from urllib.parse import urlsplit

from crawld.fetch import FetchResult
from crawld.fetch.reasons import Kind, Reason
from crawld.process.files import pid_running

UNREACHABLE = frozenset({Reason.CONNECTION, Reason.TIMEOUT, Reason.DNS, Reason.ROBOTS_UNAVAILABLE})
DEFAULT_PORTS = {"http": 80, "https": 443}
PROBE_TARGETS = 5
EVIDENCE_FRESH_S = 30.0       # a sibling's list older than this is not evidence any more
EVIDENCE_REFRESH_S = 1.0      # at most one write, and one read of the siblings, per second

Site = tuple[str, int]


class NetworkBreaker:
    """Thread-safe: pool threads ``record`` each fetch; the pause probe calls ``probe``."""

    def __init__(self, window: int, ratio: float, min_sites: int,
                 connect_timeout_s: float = 5.0, evidence: "HostEvidence | None" = None) -> None:
        self.window = window
        self.ratio = ratio
        self.min_sites = min_sites
        self.connect_timeout_s = connect_timeout_s
        self.evidence = evidence
        self._lock = threading.Lock()
        self._recent: deque[Site | None] = deque(maxlen=window)   # None: reached
        self._tripped_on: list[Site] = []     # the sites that made the case, while open

    def record(self, result: FetchResult) -> bool:
        """Count one outcome; True when it is an unreachable site and the breaker is open."""
        return self.note(unreachable_site(result))

    def note(self, site: Site | None) -> bool:
        """Count one site this worker could not reach (None: one that answered); True when
        it was unreachable and the breaker is open."""
        with self._lock:
            self._recent.append(site)
            tripped = site is not None and self._open()
            if self.evidence is not None:
                # On the trip, at once: this worker pauses and notes nothing more, so a
                # write skipped by the once-a-second limit would never come.
                self.evidence.publish(self._failed, paused=bool(self._tripped_on), force=tripped)
            return tripped

    def _failed(self) -> set[Site]:
        return {site for site in self._recent if site is not None}

    def _failing(self) -> list[Site]:
        """The distinct unreachable sites of the window, oldest first."""
        return list(dict.fromkeys(site for site in self._recent if site is not None))

    def _open(self) -> bool:
        """Mostly failures, over at least ``min_sites`` sites of the host, judged on a full
        window; or on fewer outcomes of our own once a sibling has judged and paused (a
        worker owning one site with a few tasks left would spend their attempts first)."""
        failed = [site for site in self._recent if site is not None]
        if len(failed) < self.ratio * len(self._recent):
            return False
        if len(self._recent) < self.window and not (self.evidence and self.evidence.sibling_paused()):
            return False
        sites = self._failing()
        if len(sites) < self.min_sites and self.evidence is not None:
            sites += sorted(self.evidence.siblings() - set(sites))
        if len(sites) < self.min_sites:
            return False
        self._tripped_on = sites
        return True

    def refresh(self) -> None:
        """While paused: keep telling the host (a list not rewritten goes stale)."""
        if self.evidence is not None:
            with self._lock:
                if self._tripped_on:
                    self.evidence.publish(self._failed, paused=True)

    def reset(self) -> None:
        """After the pause ends: judge the network again on fresh outcomes only."""
        with self._lock:
            self._recent.clear()
            self._tripped_on = []
            if self.evidence is not None:
                self.evidence.publish(set, paused=False, force=True)

    def probe(self) -> None:
        """Raises unless a TCP connect to one of the sites that made the case succeeds
        (this worker's own first): one of this worker's own may be down for good while
        its siblings' came back."""
        with self._lock:
            sites = (self._tripped_on or self._failing())[:PROBE_TARGETS]
        errors = probe_connect(sites, self.connect_timeout_s)
        if len(errors) == len(sites):
            raise ConnectionError(f"no site reachable: {'; '.join(errors) or 'no site to probe'}")


def unreachable_site(result: FetchResult) -> Site | None:
    """The (host, port) a fetch could not reach at all, None for any other outcome."""
    if result.kind != Kind.ERROR or result.reason not in UNREACHABLE or result.http_status:
        return None
    if result.reason == Reason.DNS and "NXDOMAIN" in result.error:
        return None        # a real answer from a working resolver: the name does not exist
    return site_of(result.url)


def site_of(url: str) -> Site | None:
    """The origin a URL is fetched from, as (host, port); None when it has none."""
    parts = urlsplit(url)
    if not parts.hostname:
        return None
    try:
        port = parts.port or DEFAULT_PORTS.get(parts.scheme, 80)
    except ValueError:
        return None
    return parts.hostname, port


def probe_connect(sites: Iterable[tuple[str, int]], timeout_s: float) -> list[str]:
    """Try each site; return one error line per site that did not accept a connection."""
    errors = []
    for host, port in sites:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as exc:
            errors.append(f"{host}:{port} {exc}")
    return errors


class HostEvidence:
    """The unreachable sites of every worker of this host (one run dir), through files.

    Each worker writes its own list, and whether it is paused on it, to ``<dir>/<pid>.json``
    (atomically, at most once a second unless forced) and reads its siblings' fresh files
    when its own evidence is short. A file not written for EVIDENCE_FRESH_S is ignored,
    and one whose worker no longer runs is removed, so a killed worker's list does not
    outlive it. Thread-safe under the breaker's lock.
    """

    def __init__(self, directory: str | Path, name: str | None = None) -> None:
        self.dir = Path(directory)
        self.own = self.dir / f"{name or os.getpid()}.json"
        self._published: tuple[set[Site], bool] = (set(), False)
        self._written_at = 0.0
        self._siblings: tuple[set[Site], bool] = (set(), False)
        self._read_at = 0.0

    def publish(self, failed: Callable[[], set[Site]], paused: bool, force: bool = False) -> None:
        """Write this worker's unreachable sites: at most once a second (refreshing the file
        while failures go on), or at once when ``force``d and something changed. ``failed``
        is called only when a write may be due (this runs on every fetch)."""
        now = time.monotonic()
        due = now - self._written_at >= EVIDENCE_REFRESH_S
        if not (due or force):
            return
        sites = failed()
        state = (sites, paused)
        if state == self._published and not due:
            return
        if not sites and not paused and self._published == (set(), False):
            return              # nothing to tell, and nothing told
        self._written_at = now
        self._published = state
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = self.own.with_suffix(".tmp")
            tmp.write_text(json.dumps({"unreachable": sorted(f"{host}:{port}" for host, port in sites),
                                       "paused": paused}))
            os.replace(tmp, self.own)
        except OSError:
            pass            # evidence is an aid: a full disk must not stop the fetches

    def siblings(self) -> set[Site]:
        """The sites the other workers of this host cannot reach."""
        return self._read()[0]

    def sibling_paused(self) -> bool:
        """Whether another worker of this host is paused on the network now."""
        return self._read()[1]

    def _read(self) -> tuple[set[Site], bool]:
        now = time.monotonic()
        if now - self._read_at >= EVIDENCE_REFRESH_S:
            self._read_at = now
            self._siblings = self._read_siblings()
        return self._siblings

    def _read_siblings(self) -> tuple[set[Site], bool]:
        sites: set[Site] = set()
        paused = False
        try:
            paths = [p for p in self.dir.glob("*.json") if p != self.own]
        except OSError:
            return sites, paused
        for path in paths:
            if _writer_is_gone(path):
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            try:
                if time.time() - path.stat().st_mtime > EVIDENCE_FRESH_S:
                    continue
                told = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(told, dict):
                continue
            paused = paused or told.get("paused") is True
            for entry in told.get("unreachable") or ():
                host, _, port = str(entry).rpartition(":")
                if host and port.isdigit():
                    sites.add((host, int(port)))
        return sites, paused

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.own.unlink()


def _writer_is_gone(path: Path) -> bool:
    """A list named after a process that no longer runs (a worker killed before it could
    remove it): not evidence, even while fresh."""
    return path.stem.isdigit() and not pid_running(int(path.stem))
