"""Shard ownership as leases in the JetStream KV bucket ``CRAWL_SHARDS``.

nats-py has no priority groups / pinned clients (and ADR-42 says pinning is no exclusivity
guarantee anyway), so a worker owns a shard by holding a lease:

    shard.<label>  -> {"owner": worker_id, "expires": unix_time}
    worker.<id>    -> {"owner": worker_id, "expires": unix_time}   (who is alive)

Every write is a compare-and-set on the key's revision (``create`` when absent,
``update(last=rev)`` to renew or to take over an expired lease, ``delete(last=rev)`` to
release), so two workers can never both believe a claim succeeded. A lease is renewed
every second and lives ``LEASE_TTL_S``; a worker whose last accepted renewal is older than
``LEASE_TTL_S - FENCE_MARGIN_S`` stops handing out that shard's messages (self-fencing)
before anyone else may take the lease over.

Fair share: live workers sorted by key, ``shards // n`` each and one more for the first
``shards % n`` of them, so the spread is always within one shard.

Fair share of the *work*: a count-fair spread can still leave a worker with only empty
shards while another holds every site that has URLs. So each worker's key also says how many
busy shards it holds (pending or in flight); a worker above ``ceil(total / n)`` busy shards,
while another live worker is below it by more than a tenth, gives the surplus back
(gracefully, as any release) with a ``busy`` mark on the freed key. Workers below their busy
share claim such shards even beyond their count quota (their idle shards then go as count
excess); a worker below its count quota takes marked shards first if it is also below its
busy share, and otherwise leaves them alone for ``HANDOFF_GRACE_S``, as the releaser does.
No hand-off while any release of ours is still settling, nor while any shard is unowned
(someone's claims are under way: the busy counts are stale).

A worker claims nothing until its own key has been up for one renewal interval, so workers
started together see each other and split the shards from their first claims.

Everything here runs on the owning transport's asyncio loop; nothing is thread-safe.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import nats.errors
import nats.js.errors as jse
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from crawld.fleet.partition import shard_label
from crawld.transports.jetstream.connection import log

BUCKET = "CRAWL_SHARDS"
LEASE_TTL_S = 6.0
RENEW_EVERY_S = 1.0
FENCE_MARGIN_S = 2.0           # stop using a lease this long before it can expire
KV_TIMEOUT_S = 1.0             # a renewal that takes longer is as good as failed
# Keys nobody rewrites for this long vanish (dead workers' keys, abandoned leases).
BUCKET_MAX_AGE_S = 300.0
WATCH_INACTIVE_S = 2.0         # the snapshot's ephemeral consumer is gone soon after
BALANCE_EVERY_S = 2.0          # busy shards move at most this often per worker
HANDOFF_GRACE_S = 5.0          # the releaser does not take back a shard it handed off before this

KV_ERRORS = (OSError, asyncio.TimeoutError, nats.errors.Error)
_KEY_UNSAFE = re.compile(r"[^-_=a-zA-Z0-9]")


def shard_key(shard: int, shards: int) -> str:
    return f"shard.{shard_label(shard, shards)}"


def worker_key(worker_id: str) -> str:
    """KV keys allow ``[-/_=.a-zA-Z0-9]``; a worker id is ``host:pid``."""
    return "worker." + _KEY_UNSAFE.sub("_", worker_id)


async def open_bucket(js: JetStreamContext, replicas: int) -> KeyValue:
    """Bind ``CRAWL_SHARDS``, creating it (history 1) when missing."""
    try:
        return await js.key_value(BUCKET)
    except jse.BucketNotFoundError:
        pass
    try:
        kv = await js.create_key_value(KeyValueConfig(
            bucket=BUCKET, history=1, replicas=replicas, ttl=BUCKET_MAX_AGE_S,
            storage=StorageType.FILE, description="crawld shard ownership leases"))
        log.info("shard_bucket_created", bucket=BUCKET, replicas=replicas)
        return kv
    except jse.BadRequestError:   # another worker created it first
        return await js.key_value(BUCKET)


@dataclass
class Lease:
    shard: int
    revision: int
    renewed_at: float           # monotonic time the server last accepted our write
    releasing: bool = False


@dataclass(frozen=True)
class Entry:
    """One key as read from the bucket."""

    owner: str
    expires: float       # a lease's end; a busy hand-off's release time
    revision: int
    deleted: bool = False
    busy: int = 0        # worker key: busy shards held; shard key: given back while busy
    owned: int = -1      # worker key: leases held when it wrote this

    def free(self, now: float) -> bool:
        return self.deleted or self.expires <= now


@dataclass
class Plan:
    """What one tick changed; the transport acts on it."""

    claimed: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)      # fenced or taken: stop at once
    excess: list[int] = field(default_factory=list)    # above fair share: release gracefully


@dataclass
class Table:
    shards: dict[int, Entry]
    workers: dict[str, Entry]


class ShardLeases:
    """The lease side of one worker: claim, renew, fence, release."""

    def __init__(self, kv: KeyValue | None, worker_id: str, shards: int,
                 ttl_s: float = LEASE_TTL_S, fence_margin_s: float = FENCE_MARGIN_S,
                 cost: Callable[[int], int] | None = None,
                 busy: Callable[[int], bool] | None = None,
                 on_claimed: Callable[[int], None] = lambda shard: None,
                 first_claim_after_s: float = RENEW_EVERY_S) -> None:
        self.kv = kv
        self.on_claimed = on_claimed             # politeness: the shard's sites wait one delay
        self.worker_id = worker_id
        self.key = worker_key(worker_id)
        self.shards = shards
        self.ttl_s = ttl_s
        self.fence_after_s = max(0.5, ttl_s - fence_margin_s)
        self.cost = cost or (lambda shard: 0)    # in-flight deliveries: release cheap shards first
        self.busy = busy or (lambda shard: False)  # has pending or in-flight messages
        self._handing_off: set[int] = set()      # releasing to a starved worker: mark the key
        self._handed_off_at: dict[int, float] = {}  # shard -> monotonic time we gave it away
        self._balanced_at = 0.0
        self._taken_busy_at: dict[int, float] = {}  # shard -> when a hand-off came to us
        # Workers started together see each other before anyone claims: no worker grabs
        # every shard for a second only to give most of them back.
        self.first_claim_after_s = first_claim_after_s
        self._announced_at: float | None = None
        self.owned: dict[int, Lease] = {}
        self._fenced: dict[int, int] = {}        # shard -> our last revision, to free
        self.claims = self.releases = self.losses = 0
        self.handovers = 0      # shards taken over from another owner, released or lost
        self.quota: int | None = None
        self.live_workers = 0

    def bind(self, kv: KeyValue) -> None:
        """A new connection object: same leases, new handle."""
        self.kv = kv

    # -- questions the transport asks on its hot path ------------------------------------
    def owned_shards(self) -> list[int]:
        return sorted(self.owned)

    def valid(self, shard: int) -> bool:
        """May a message of ``shard`` be handed out now? Only under a fresh lease."""
        lease = self.owned.get(shard)
        return lease is not None and time.monotonic() - lease.renewed_at <= self.fence_after_s

    def mark_releasing(self, shard: int) -> None:
        if shard in self.owned:
            self.owned[shard].releasing = True

    # -- one tick ------------------------------------------------------------------------
    async def tick(self, claim: bool = True, give: bool = True) -> Plan:
        """Renew, fence, announce ourselves, then balance towards fair share: ``give`` back
        what is above it (count excess, busy surplus), ``claim`` what is below it. A worker
        that has stopped consuming for a while (paused on a fault of its own) gives but does
        not claim: another worker may fetch its surplus sites meanwhile, and a worker that
        took every shard before the others came up must not keep them all while it waits."""
        plan = Plan()
        plan.lost += await self._renew()
        plan.lost += self.fence()
        await self._drop_fenced()
        await self._heartbeat()
        if not (claim or give) or not self._announced_long_enough():
            return plan
        try:
            table = await self.snapshot()
        except KV_ERRORS as exc:
            log.warning("shard_table_unreadable", worker=self.worker_id, error=repr(exc))
            return plan
        quota = self._quota(table)
        active = self._active()
        if len(active) > quota and give:
            plan.excess = sorted(active, key=self._release_order)[: len(active) - quota]
            for shard in plan.excess:
                self.mark_releasing(shard)
        elif len(active) < quota and claim:
            plan.claimed = await self._claim_free(table, quota - len(active))
        share = None if plan.claimed or plan.excess else self._busy_share(table)
        if share is None:
            return plan       # counts still moving: the busy numbers would mislead
        mine, fair, least = share
        # A gap of a shard or two between large shares is noise (a shard drained a moment
        # ago): moving one would cost more than it evens out.
        if (give and mine > fair and least < fair and mine - least > max(1, fair // 10)
                and self._all_owned(table)):
            plan.excess += self._hand_off(min(mine - fair, fair - least))
        elif mine < fair and claim:
            plan.claimed += await self._claim_handed_off(table, fair - mine)
        return plan

    def _release_order(self, shard: int) -> tuple[bool, bool, int, int]:
        """Count excess goes idle shards first, then the least in flight; a busy shard
        handed to us a moment ago goes last, or it would bounce straight back."""
        just_taken = self._taken_busy_at.get(shard, -math.inf) > time.monotonic() - HANDOFF_GRACE_S
        return just_taken, self.busy(shard), self.cost(shard), -shard

    def _gave_away_lately(self, shard: int) -> bool:
        """We handed ``shard`` off within HANDOFF_GRACE_S: leave it to a starved worker."""
        return self._handed_off_at.get(shard, -math.inf) > time.monotonic() - HANDOFF_GRACE_S

    def _active(self) -> list[int]:
        return [s for s, lease in self.owned.items() if not lease.releasing]

    def busy_count(self) -> int:
        return sum(1 for s in self._active() if self.busy(s))

    def _busy_share(self, table: Table, settled: bool = True) -> tuple[int, int, int] | None:
        """(busy shards I hold, the fair number, the fewest any other live worker holds);
        None while a worker's announced lease count differs from the table's (its claims
        or releases are under way, so its busy count is stale), unless ``settled`` is
        False: then the announced counts, stale or not."""
        now = time.time()
        held = Counter(e.owner for e in table.shards.values() if not e.free(now))
        others = []
        for key, entry in table.workers.items():
            if key == self.key or entry.free(now):
                continue
            if settled and entry.owned != held.get(entry.owner, 0):
                return None
            others.append(entry.busy)
        mine = self.busy_count()
        fair = math.ceil((mine + sum(others)) / (len(others) + 1))
        return mine, fair, min(others, default=fair)

    def _below_busy_share(self, table: Table) -> bool:
        share = self._busy_share(table, settled=False)
        return share is not None and share[0] < share[1]

    def _all_owned(self, table: Table) -> bool:
        """Every shard has a live lease. Until then someone's claims are under way and the
        busy counts are stale: two workers started together, one read the table a few ms
        before the other's second round of claims and handed it 9 busy shards; shards then
        bounced between them for 10 s, their sites idle for 2-7 s at each move."""
        now = time.time()
        return sum(1 for e in table.shards.values() if not e.free(now)) >= self.shards

    def _hand_off(self, surplus: int) -> list[int]:
        """Give back ``surplus`` busy shards (the fewest in flight first), at most once
        every ``BALANCE_EVERY_S``: the counts others announce are up to a tick old."""
        now = time.monotonic()
        releasing = any(lease.releasing for lease in self.owned.values())
        if releasing or now - self._balanced_at < BALANCE_EVERY_S:
            return []     # shards still on their way out would be counted twice
        self._balanced_at = now
        busy = sorted((s for s in self._active() if self.busy(s)), key=lambda s: (self.cost(s), -s))
        picked = busy[:surplus]
        for shard in picked:
            self.mark_releasing(shard)
            self._handing_off.add(shard)
        log.info("shard_hand_off", worker=self.worker_id, shards=picked, surplus=surplus)
        return picked

    async def _claim_handed_off(self, table: Table, wanted: int) -> list[int]:
        """Below my busy share: take shards given back while busy, beyond the count quota."""
        now = time.time()
        offered = [s for s, e in table.shards.items()
                   if e.busy and e.free(now) and not e.deleted and s not in self.owned
                   and not self._gave_away_lately(s)]
        won = await asyncio.gather(*(self.claim(s, table.shards[s]) for s in offered[:wanted]))
        taken = [s for s, ok in zip(offered, won) if ok]
        for shard in taken:
            self._taken_busy_at[shard] = time.monotonic()
        return taken

    def fence(self) -> list[int]:
        """Drop every lease whose last renewal is too old to trust (it may expire soon and
        another worker may take it): the caller stops that shard at once."""
        now = time.monotonic()
        stale = [s for s, lease in self.owned.items() if now - lease.renewed_at > self.fence_after_s]
        for shard in stale:
            lease = self.owned.pop(shard)
            self._fenced[shard] = lease.revision
            self._lost(shard, "fenced", since_renewal_s=round(now - lease.renewed_at, 2))
        return stale

    async def _drop_fenced(self) -> None:
        """Free fenced claims that are still ours (delete with our last revision), so no
        one waits out the TTL; best effort: unreachable now means they simply expire."""
        fenced, self._fenced = self._fenced, {}
        if fenced:
            await asyncio.gather(*(self._delete(s, rev) for s, rev in fenced.items()))

    async def _renew(self) -> list[int]:
        if not self.owned or self.kv is None:
            return []
        shards = list(self.owned)
        results = await asyncio.gather(*(self._renew_one(s) for s in shards), return_exceptions=True)
        lost = []
        for shard, result in zip(shards, results):
            if isinstance(result, jse.KeyWrongLastSequenceError):
                self.owned.pop(shard, None)   # someone else's now: never touch it again
                self._lost(shard, "taken")
                lost.append(shard)
            elif isinstance(result, BaseException):
                log.debug("shard_renew_failed", shard=shard, worker=self.worker_id, error=repr(result))
        return lost

    async def _renew_one(self, shard: int) -> None:
        lease = self.owned[shard]
        sent = time.monotonic()    # the lease is valid from when we asked, not when answered
        revision = await asyncio.wait_for(
            self.kv.update(shard_key(shard, self.shards), self._value(), last=lease.revision),
            KV_TIMEOUT_S)
        if self.owned.get(shard) is lease:
            lease.revision, lease.renewed_at = revision, sent

    async def _heartbeat(self) -> None:
        if self.kv is None:
            return
        try:
            await asyncio.wait_for(self.kv.put(self.key, self._value(self.busy_count(), len(self.owned))), KV_TIMEOUT_S)
        except KV_ERRORS as exc:
            log.debug("worker_key_failed", worker=self.worker_id, error=repr(exc))
            return
        if self._announced_at is None:
            self._announced_at = time.monotonic()

    def _announced_long_enough(self) -> bool:
        return (self._announced_at is not None
                and time.monotonic() - self._announced_at >= self.first_claim_after_s)

    # -- reading the table -----------------------------------------------------------------
    async def snapshot(self) -> Table:
        """Every key's last value (one ephemeral ordered consumer, read to its end)."""
        assert self.kv is not None
        watcher = await self.kv.watchall(inactive_threshold=WATCH_INACTIVE_S)
        table = Table({}, {})
        try:
            while (entry := await watcher.updates(timeout=KV_TIMEOUT_S * 2)) is not None:
                self._add(table, entry)
        finally:
            await watcher.stop()
        return table

    def _add(self, table: Table, entry: Any) -> None:
        deleted = entry.operation in ("DEL", "PURGE")
        try:
            value = {} if deleted else json.loads(entry.value or b"{}")
            parsed = Entry(str(value.get("owner", "")), float(value.get("expires", 0)),
                           entry.revision, deleted, int(value.get("busy", 0)),
                           int(value.get("owned", -1)))
        except (ValueError, TypeError, AttributeError):
            parsed = Entry("", 0.0, entry.revision)    # garbage: treat as an expired lease
        if entry.key.startswith("worker."):
            table.workers[entry.key] = parsed
        elif entry.key.startswith("shard."):
            label = entry.key[len("shard."):]
            if label.isdigit() and int(label) < self.shards:
                table.shards[int(label)] = parsed

    def _quota(self, table: Table) -> int:
        now = time.time()
        live = sorted({k for k, e in table.workers.items() if not e.free(now)} | {self.key})
        base, extra = divmod(self.shards, len(live))
        self.live_workers = len(live)
        self.quota = base + (1 if live.index(self.key) < extra else 0)
        return self.quota

    # -- claiming and releasing --------------------------------------------------------------
    async def _claim_free(self, table: Table, wanted: int) -> list[int]:
        now = time.time()
        free = [s for s in range(self.shards)
                if s not in self.owned and not self._gave_away_lately(s)
                and (s not in table.shards or table.shards[s].free(now))]
        if not self._below_busy_share(table):
            free = [s for s in free if not self._reserved_for_the_starved(table.shards.get(s), now)]
        random.shuffle(free)      # workers claiming at once mostly try different shards
        free.sort(key=lambda s: not (s in table.shards and table.shards[s].busy))   # work first
        picked = free[:wanted]    # all at once (CAS makes that safe); a lost race waits a tick
        won = await asyncio.gather(*(self.claim(s, table.shards.get(s)) for s in picked))
        return [s for s, ok in zip(picked, won) if ok]

    @staticmethod
    def _reserved_for_the_starved(entry: Entry | None, now: float) -> bool:
        """A shard handed off busy goes to a worker below its busy share. Two workers above
        it that each gave one away were also one short of their count quota, and took each
        other's (found on CI: 3 workers, 10 sites, two swapped sites for 10 s while the
        third fetched nothing). Once the mark is HANDOFF_GRACE_S old, anyone may take it:
        the busy counts moved on and no one is starved, but the shard must not stay unowned."""
        return (entry is not None and bool(entry.busy) and not entry.deleted
                and now - entry.expires < HANDOFF_GRACE_S)

    async def claim(self, shard: int, seen: Entry | None) -> bool:
        """CAS on what we read: ``create`` if the key was absent or deleted, else
        ``update(last=seen.revision)``; False when anyone wrote the key in between."""
        assert self.kv is not None
        key = shard_key(shard, self.shards)
        sent = time.monotonic()
        try:
            if seen is None or seen.deleted:
                revision = await asyncio.wait_for(self.kv.create(key, self._value()), KV_TIMEOUT_S)
            else:
                revision = await asyncio.wait_for(
                    self.kv.update(key, self._value(), last=seen.revision), KV_TIMEOUT_S)
        except jse.KeyWrongLastSequenceError:
            return False
        except KV_ERRORS as exc:
            log.debug("shard_claim_failed", shard=shard, worker=self.worker_id, error=repr(exc))
            return False
        self.owned[shard] = Lease(shard, revision, sent)
        self.claims += 1
        self.on_claimed(shard)
        took_over = seen is not None and not seen.deleted and seen.owner not in ("", self.worker_id)
        self.handovers += took_over
        log.info("shard_claimed", shard=shard, worker=self.worker_id, revision=revision,
                 previous_owner=seen.owner if took_over and seen else None,
                 quota=self.quota, live_workers=self.live_workers)
        return True

    async def release(self, shard: int, reason: str = "rebalance") -> bool:
        """Give a lease back (delete with our revision) so another worker claims it at once;
        a busy hand-off instead leaves a marked free entry for a starved worker."""
        lease = self.owned.pop(shard, None)
        if lease is None:
            return False
        self.releases += 1
        self.handovers += 1
        if shard in self._handing_off:
            self._handing_off.discard(shard)
            self._handed_off_at[shard] = time.monotonic()
            freed = await self._mark_handed_off(shard, lease.revision)
            reason = "busy_hand_off"
        else:
            freed = await self._delete(shard, lease.revision)
        log.info("shard_released", shard=shard, worker=self.worker_id, reason=reason, deleted=freed)
        return freed

    async def _mark_handed_off(self, shard: int, revision: int) -> bool:
        if self.kv is None:
            return False
        value = json.dumps({"owner": "", "expires": round(time.time(), 3), "busy": 1},
                           separators=(",", ":")).encode()
        try:
            await asyncio.wait_for(self.kv.update(shard_key(shard, self.shards), value, last=revision),
                                   KV_TIMEOUT_S)
            return True
        except jse.KeyWrongLastSequenceError:
            return False
        except KV_ERRORS as exc:
            log.debug("shard_hand_off_failed", shard=shard, worker=self.worker_id, error=repr(exc))
            return False

    async def release_all(self) -> None:
        """Close: every lease and our worker key go at once (after the deliveries settled)."""
        await asyncio.gather(*(self.release(s, reason="closing") for s in list(self.owned)))
        if self.kv is not None:
            try:
                await asyncio.wait_for(self.kv.delete(self.key), KV_TIMEOUT_S)
            except KV_ERRORS as exc:
                log.debug("worker_key_delete_failed", worker=self.worker_id, error=repr(exc))

    async def _delete(self, shard: int, revision: int) -> bool:
        if self.kv is None:
            return False
        try:
            await asyncio.wait_for(self.kv.delete(shard_key(shard, self.shards), last=revision),
                                   KV_TIMEOUT_S)
            return True
        except jse.APIError:           # wrong last sequence: someone else holds it now
            return False
        except KV_ERRORS as exc:
            log.debug("shard_delete_failed", shard=shard, worker=self.worker_id, error=repr(exc))
            return False

    def _lost(self, shard: int, reason: str, **extra: Any) -> None:
        self._handing_off.discard(shard)
        self.losses += 1
        self.handovers += 1
        log.warning("shard_lost", shard=shard, worker=self.worker_id, reason=reason, **extra)

    def _value(self, busy: int | None = None, owned: int | None = None) -> bytes:
        """A lease (no counts) or this worker's key (with its busy and lease counts)."""
        value: dict[str, Any] = {"owner": self.worker_id, "expires": round(time.time() + self.ttl_s, 3)}
        if owned is not None:
            value.update(busy=busy or 0, owned=owned)
        return json.dumps(value, separators=(",", ":")).encode()
