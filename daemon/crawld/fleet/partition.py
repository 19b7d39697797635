"""Which shard a task belongs to: every URL of one site goes to one shard, one owner.

StormCrawler's URLPartitionerBolt (byHost / byDomain) and Nutch's ``partition.url.mode``
do the same: the owner of a shard is the only process fetching its sites, so it can
enforce per-site concurrency and delay in memory, for the whole fleet.

The shard of a key is ``blake2b(key) mod shards``: the same in every process, host and
Python version (``hash()`` is salted per process and would scatter a site).
"""
from __future__ import annotations

import functools
import hashlib
import math
import re
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from crawld.config import Config

PARTITION_MODES = ("host", "domain", "none")
# A worker holding its fair share of the shards may hold this many hands of tasks in all
# (the shard windows' sum): the surplus waits for its sites in the worker without a thread.
HANDS_HELD = 4


# A URL whose host urlsplit would return as it stands: lower-case letters, digits, dots and
# hyphens, no user info or brackets, then a port, a path, a query, a fragment or the end.
_PLAIN_HOST = re.compile(r"https?://([a-z0-9.-]+)(?::[0-9]*)?(?:[/?#]|\Z)")


def site_of(url: str) -> str:
    """The politeness key of a URL: its host name, lower-cased, without port or trailing dot
    (robots.txt stays per origin; politeness is per host, whatever the port)."""
    url = url.strip()
    plain = _PLAIN_HOST.match(url)
    if plain is not None:       # most URLs: urlsplit's answer without urlsplit's cost
        return plain.group(1).rstrip(".")
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        return ""
    return host.rstrip(".").lower()


@functools.lru_cache(maxsize=1)
def _suffix_list():
    # publicsuffixlist ships the Public Suffix List in the package: no network at runtime.
    from publicsuffixlist import PublicSuffixList
    return PublicSuffixList()


@functools.lru_cache(maxsize=65536)
def registrable_domain(host: str) -> str:
    """``www.example.co.uk`` -> ``example.co.uk``; an IP literal or a bare suffix stays as is."""
    if not host or host.replace(".", "").isdigit() or ":" in host:
        return host
    return _suffix_list().privatesuffix(host) or host


def partition_key(url: str, mode: str) -> str:
    """The key whose hash picks the shard: the host, or its registrable domain."""
    return partition_key_of_host(site_of(url), mode)


def partition_key_of_host(host: str, mode: str) -> str:
    return registrable_domain(host) if mode == "domain" else host


@functools.lru_cache(maxsize=65536)     # a publish or a crawl sees the same sites over and over
def shard_of_key(key: str, shards: int) -> int:
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def shard_of(url: str, mode: str, shards: int) -> int | None:
    """The shard of ``url``; None when the fleet is not partitioned (``mode = "none"``)."""
    if mode == "none":
        return None
    return shard_of_key(partition_key(url, mode), shards)


def shard_label(shard: int, shards: int) -> str:
    """Zero-padded, so names sort: ``07`` of 64, ``007`` of 512."""
    return f"{shard:0{len(str(max(1, shards - 1)))}d}"


def shard_window(cfg: "Config") -> int:
    """How many of one shard's tasks a worker holds at once (AMQP: the shard consumer's
    prefetch; JetStream: the cap on what its pulls bring in, where the second rule sets it).

    At least 2 x per_host_concurrency and never above queue.prefetch. Big enough that a
    worker holding its fair share of the shards (shards / this host's workers) has tasks
    of every site waiting although shards get unequal numbers of sites (hashing):
    HANDS_HELD times its hand over that share. What waits for its site's politeness slots
    waits in the worker without a thread (process/sitegate.py), and free threads go to the
    sites running the fewest fetches, so sites progress evenly only if the sites of a big
    shard have tasks of their own waiting too. 500 sites on 2 x 256 threads: 32 (at 16 the
    3-site shards' sites were done in half the time and the 15-site shards' made a tail;
    at 2 x per_host_concurrency = 4, half the threads were idle).
    """
    hand = min(cfg.queue.prefetch, cfg.workers.threads)
    fair_share = math.ceil(cfg.queue.shards / max(1, cfg.workers.count))
    spread = math.ceil(HANDS_HELD * hand / fair_share)
    return max(1, min(cfg.queue.prefetch, max(2 * cfg.fetch.per_host_concurrency, spread)))


def shard_pull_cap(cfg: "Config") -> int | None:
    """The window as a cap on one JetStream shard's pulls, or None where it does not apply:
    only where the second rule sets it (a worker of a few sites keeps pulling as before,
    its network breaker must see their outcomes soon) and below the worker's own hand
    (else it never binds)."""
    window = shard_window(cfg)
    hand = min(cfg.queue.prefetch, cfg.workers.threads)
    return window if 2 * cfg.fetch.per_host_concurrency < window < hand else None
