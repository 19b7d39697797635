"""The partitioned side of JetStreamTransport: intake routing, shard pulls, lease ticks.

With ``queue.partition`` host / domain, a worker

* pulls the intake durable (``crawl.url.>``) and **routes** each message to its shard
  subject: parse, publish with PubAck, only then ack the intake copy (a failed publish is
  a nak with a delay: routing never loses). What does not parse goes to the worker's
  normal delivery callback unchanged, so the handler dead-letters it with a store row;
* holds leases (leases.py) and runs one pull task per owned shard durable. Free worker
  slots are global, so they are granted to the shard pulls (``_allocate``): busy shards
  first, round robin, then drained shards probe with one slot each;
* gives a shard up in two ways: *release* (above fair share: stop pulling, wait until the
  worker settled every delivery of that shard, nak what was pulled but not handed out,
  delete the lease) or *lost* (fenced: the same at once, without waiting for in-flight).

The worker loop knows none of this: it sees deliveries and free slots, as before.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, deque
from typing import Any, Callable, Iterable

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig

from crawld.config import Config
from crawld.fleet.partition import shard_of
from crawld.task import MalformedMessage, Task, parse_message
from crawld.transports.base import Delivery
from crawld.transports.jetstream.connection import API_TIMEOUT_S, log
from crawld.transports.jetstream.leases import RENEW_EVERY_S, Plan, ShardLeases, open_bucket
from crawld.transports.jetstream.pulls import Pull
from crawld.transports.jetstream.replies import Replies
from crawld.transports.jetstream.settle import Held, nak_payload
from crawld.transports.jetstream.topology import (MSG_ID_HEADER, STREAM, consumer_config,
                                                  ensure_consumer_info,
                                                  shard_consumer_config, shard_consumer_name,
                                                  shard_of_subject, shard_subject)

FETCH_EXPIRY_S = 1.0         # short pull requests: a restarted server is noticed within ~1 s
MAX_FETCH_BATCH = 256
MIN_PROBE_EXPIRY_S = 0.1     # a drained shard's probe when such shards outnumber free slots
MAX_PROBE_EXPIRY_S = 0.5     # a probe holds its slot at most this long
GRANT_WAIT_S = 0.5           # a waiting shard pull re-checks this often even without a grant
ROUTE_BATCH = 64             # intake messages routed per pull (routing uses no worker slot)
ROUTE_RETRY_DELAY_S = 1.0    # nak delay when the shard publish failed
BUSY_MEMORY_S = 5.0          # a shard that had work this recently still counts as busy
ROUTED_SUFFIX = ".routed"    # the routed copy's Nats-Msg-Id: intake and shards share one dedup window


def routed_body(body: bytes, task: Task) -> bytes:
    """The same body, with the task id in it (a plain client may have sent the id only as
    Nats-Msg-Id; the routed copy's header id differs, so the body must carry it)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    if obj.get("task_id") == task.task_id:
        return body
    obj["task_id"] = task.task_id
    return json.dumps(obj, separators=(",", ":")).encode()


def routed_headers(headers: dict[str, str], task: Task) -> dict[str, str]:
    """Our own headers travel on; the server's (``Nats-*``) do not. The id is derived from
    the intake id, so a re-routed redelivery is dropped as a duplicate, while a replay sent
    to intake under a fresh id (``<id>:replay:<ms>``) is not."""
    out = {k: str(v) for k, v in headers.items() if not k.startswith("Nats-")}
    incoming = headers.get(MSG_ID_HEADER) or task.task_id
    out[MSG_ID_HEADER] = (task.task_id if incoming == task.task_id else incoming) + ROUTED_SUFFIX
    return out


class ShardMixin:
    """Routing and shard ownership for JetStreamTransport (consumer.py owns the state)."""

    cfg: Config
    worker_id: str
    _loop: asyncio.AbstractEventLoop
    _nc: Client | None
    _js: JetStreamContext | None
    _pulls: dict[str, Pull]
    _held: dict[int, Held]
    _backlog: deque[Msg]
    _pull_cap: int | None
    _window: int
    _leases: ShardLeases | None
    _replies: Replies
    _lease_task: asyncio.Task[None] | None
    _consuming: bool
    _closing: bool
    _partitioned: bool
    _wait_wake: Callable[[float], Any]
    _fetch: Callable[..., Any]
    _bucket_rebind: bool
    routed: int
    connected: bool
    _slots: Callable[[], int]
    _dispatch: Callable[[Msg], None]
    _take: Callable[[list[Msg]], None]
    _start_pull: Callable[[Pull], None]
    _release: Callable[[list[Msg]], Any]
    _deliveries_of: Callable[[list[Msg]], list[Delivery]]
    gave_back: Callable[[Iterable[Delivery]], None]
    _safe: Callable[..., Any]

    # -- status hooks ------------------------------------------------------------------
    def owned_shards(self) -> list[int]:
        """Shards this worker holds a lease on (empty when not partitioned)."""
        return self._leases.owned_shards() if self._leases is not None else []

    @property
    def handovers(self) -> int:
        """Ownership changes this worker took part in: took over, released or lost a shard."""
        return self._leases.handovers if self._leases is not None else 0

    # -- slots across pulls ------------------------------------------------------------
    async def _pull_shard(self, pull: Pull) -> None:
        if not pull.reserved:
            pull.waiting = True
            self._allocate()
            if not pull.reserved:
                await pull.wait_grant(GRANT_WAIT_S)
            pull.waiting = False
            if not pull.reserved or pull.stopping or not self._consuming:
                pull.reserved = 0
                return
        try:
            msgs = await self._fetch(pull, pull.reserved, pull.expiry)
        finally:
            pull.reserved = 0
        if not msgs and pull.due_at <= time.monotonic():
            pull.due_at = float("inf")    # what was due came back: plain rotation again
        self._take(msgs)
        self._allocate()      # its slots are free again: the next shard's turn

    async def _grant_loop(self) -> None:
        """Settlements free slots and wake this loop: one allocation per wake-up, not one
        wake-up of every waiting shard pull."""
        while True:
            await self._wait_wake(0.2)
            self._allocate()

    def _allocate(self) -> None:
        """Grant the worker's free slots to waiting shard pulls, so all requests in flight
        together never bring more than it can start. Busy shards (the server said more
        are pending) first, those holding the fewest here and then the longest-waiting
        first, up to what they have pending and to their cap
        (fleet.partition.shard_pull_cap), or without one to the larger of its window and
        an even share of the hand, less what they hold here; then drained shards probe
        with one slot each, round robin, with a short expiry when many share few slots
        (each is probed about once a second)."""
        # Runs after every fetch and settlement wake-up, over every shard pull (64 by
        # default): plain loops, and the idle ones sorted only when a probe may start.
        shards = [p for p in self._pulls.values() if p.shard is not None and not p.stopping]
        reserved, waiting = 0, []
        for p in shards:
            reserved += p.reserved
            if p.waiting and not p.reserved:
                waiting.append(p)
        free = self._slots() - reserved - len(self._backlog)
        if free <= 0 or not waiting:
            return
        now = time.monotonic()
        cap = self._pull_cap
        busy = [p for p in waiting if p.pending]
        in_hand = self._in_hand_by_shard() if len(busy) > 1 or (busy and cap is not None) else {}
        # The shard holding the fewest tasks here goes first: its tasks do not wait for
        # their sites (they ran and were settled), while a shard of few sites holds many
        # that do. In turn alone, every shard got as many tasks whatever its number of
        # sites, and the sites of big shards fell behind.
        busy.sort(key=lambda p: (in_hand.get(p.shard, 0), p.turn))
        held = sum(in_hand.get(p.shard, 0) for p in busy)
        for left, pull in zip(range(len(busy), 0, -1), busy):
            if free <= 0:
                return                 # drained shards wait while busy ones want slots
            own = in_hand.get(pull.shard, 0)
            # No shard beyond its window: a big pull of one shard would bring many pages
            # of its few sites, which only wait for their politeness slots. Without a
            # cap, no shard beyond its window or an even share of the hand among the busy
            # ones, whichever is more: one site's shard that took the whole hand kept the
            # other sites waiting behind its parked tasks (and at one each, no site used
            # its per_host_concurrency: bench_partition's 50 sites went at half speed).
            share = cap if cap is not None else max(self._window, -(-(free + held) // left))
            held -= own
            room = share - own
            if room > 0:
                self._grant(pull, min(free, pull.pending, MAX_FETCH_BATCH, room), FETCH_EXPIRY_S, now)
                free -= pull.reserved
        # Busy shards with a fetch in flight still have messages beyond it: keep their
        # slots for them, or probes of empty shards would slow their ramp-up.
        probing = 0
        for p in shards:
            if p.pending:
                if not p.waiting:
                    free -= max(0, p.pending - p.reserved)
            elif p.reserved:
                probing += 1
        # Drained shards in turn, those with a delayed retry due first (num_pending does
        # not count a naked message until it is due, so nothing else would announce it).
        # Probes get at most half of what is free (the rest stays for a shard found busy in
        # the meantime, which would otherwise wait out the probes' expiry).
        budget = max(0, (free + probing + 1) // 2 - probing)
        idle = [p for p in waiting if not p.pending] if budget else []
        if not idle:
            return
        idle.sort(key=lambda p: (p.due_at > now, p.turn))
        expiry = max(MIN_PROBE_EXPIRY_S, min(MAX_PROBE_EXPIRY_S, budget / len(idle)))
        for pull in idle[:budget]:
            self._grant(pull, 1, expiry, now)

    def _comes_back(self, subject: str, delay_s: float) -> None:
        shard = shard_of_subject(subject, self.cfg.queue.shards)
        pull = None if shard is None else self._pulls.get(shard_consumer_name(self.cfg, shard))
        if pull is not None:
            pull.due_at = min(pull.due_at, time.monotonic() + delay_s)

    @staticmethod
    def _grant(pull: Pull, batch: int, expiry: float, now: float) -> None:
        pull.reserved, pull.expiry, pull.turn = batch, expiry, now
        pull.granted.set()

    def _may_start(self, msg: Msg) -> bool:
        """Only under a fresh lease of a shard we are not giving up (self-fencing)."""
        shard = shard_of_subject(msg.subject, self.cfg.queue.shards)
        if shard is None or self._leases is None:
            return True
        pull = self._pulls.get(shard_consumer_name(self.cfg, shard))
        return pull is not None and not pull.stopping and self._leases.valid(shard)

    def _in_hand_by_shard(self) -> Counter[int | None]:
        """Deliveries of each shard not settled yet, and pulled ones not handed out."""
        shards = self.cfg.queue.shards
        return Counter(shard_of_subject(subject, shards) for subject in
                       [h.msg.subject for h in self._held.values() if not h.settling]
                       + [m.subject for m in self._backlog])

    def _inflight_of(self, shard: int) -> int:
        return sum(1 for h in self._held.values()
                   if shard_of_subject(h.msg.subject, self.cfg.queue.shards) == shard)

    def _busy_shard(self, shard: int) -> bool:
        """Work pending, due back, pulled or in flight, or any of that lately: between two
        pulls a busy shard can look drained for a moment, and the balance must not chase
        that (``BUSY_MEMORY_S``). A shard without a pull yet (just claimed) counts as busy:
        others must not pile more onto a worker before it has looked."""
        pull = self._pulls.get(shard_consumer_name(self.cfg, shard))
        if pull is None:
            return True
        now = time.monotonic()
        if (pull.pending > 0 or pull.due_at != float("inf") or self._inflight_of(shard)
                or any(m.subject == pull.subject for m in self._backlog)):
            pull.busy_at = now
        return now - pull.busy_at < BUSY_MEMORY_S

    def _consumer_config(self, pull: Pull) -> ConsumerConfig:
        return consumer_config(self.cfg) if pull.shard is None else shard_consumer_config(self.cfg, pull.shard)

    # -- routing intake -------------------------------------------------------------------
    async def _route_batch(self, pull: Pull) -> None:
        pull.start_request(FETCH_EXPIRY_S)
        try:
            msgs = await pull.psub.fetch(ROUTE_BATCH, timeout=FETCH_EXPIRY_S)
        except asyncio.TimeoutError:
            return
        await asyncio.gather(*(self._route(msg) for msg in msgs))

    async def _route(self, msg: Msg) -> None:
        headers = dict(msg.headers or {})
        try:
            task = parse_message(msg.data, headers.get(MSG_ID_HEADER), self.cfg.queue.max_message_bytes)
        except MalformedMessage:
            self._take([msg])       # the handler dead-letters it with its reason
            return
        shard = shard_of(task.url, self.cfg.queue.partition, self.cfg.queue.shards)
        assert shard is not None
        subject = shard_subject(shard, self.cfg.queue.shards)
        try:
            assert self._js is not None
            await self._js.publish(subject, routed_body(msg.data, task), timeout=API_TIMEOUT_S,
                                   headers=routed_headers(headers, task))
        except (AssertionError, asyncio.TimeoutError, nats.errors.Error, OSError) as exc:
            log.warning("route_failed", task_id=task.task_id, url=task.url,
                        attempt=msg.metadata.num_delivered, subject=subject, error=repr(exc),
                        retry_in_s=ROUTE_RETRY_DELAY_S)
            await self._safe(self._answer(msg, nak_payload(ROUTE_RETRY_DELAY_S)), "nak")
            return
        await self._safe(self._answer(msg, Msg.Ack.Ack), "ack")   # after the PubAck only
        self.routed += 1

    async def _answer(self, msg: Msg, payload: bytes) -> None:
        """Double ack, as settle.py does: the server has it when this returns."""
        if self._nc is None or self._nc.is_closed:
            raise nats.errors.ConnectionClosedError
        await self._replies.request(msg.reply, payload, API_TIMEOUT_S)
        msg._ackd = True

    # -- leases ----------------------------------------------------------------------------
    async def _lease_loop(self) -> None:
        while not self._closing:
            started = time.monotonic()
            try:
                await self._lease_tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:   # never let the renewals stop; fencing covers the gap
                log.warning("shard_tick_failed", worker=self.worker_id, error=repr(exc))
            await asyncio.sleep(max(0.05, RENEW_EVERY_S - (time.monotonic() - started)))

    async def _lease_tick(self) -> None:
        leases = self._leases
        assert leases is not None
        if self.connected and self._bucket_rebind and self._js is not None:
            leases.bind(await open_bucket(self._js, self.cfg.queue.replicas))
            self._bucket_rebind = False
        if self.connected:
            # paused (not consuming): give back the surplus, claim nothing
            plan = await leases.tick(claim=self._consuming and not self._closing, give=not self._closing)
        else:
            plan = Plan(lost=leases.fence())
        for shard in plan.lost:
            self._stop_shard(shard, "lost")
        for shard in plan.excess:
            if not self._stop_shard(shard, "release"):
                await leases.release(shard)    # never opened here: nothing to settle first
        await self._finish_stopped()
        if self.connected:
            await self._open_owned()

    async def _stop_lease_loop(self) -> None:
        task = self._lease_task
        if task is None or task.done():
            return
        try:   # let a tick in flight finish: a claim cut in half would linger until its TTL
            await asyncio.wait_for(asyncio.shield(task), RENEW_EVERY_S + 3.0)
        except (asyncio.TimeoutError, Exception):
            task.cancel()

    def _stop_shard(self, shard: int, reason: str) -> bool:
        """Stop pulling ``shard``; False when it has no pull here at all."""
        pull = self._pulls.get(shard_consumer_name(self.cfg, shard))
        if pull is None:
            return False
        if not pull.stopping:
            pull.stopping, pull.stop_reason, pull.stopped_at = True, reason, time.monotonic()
            pull.granted.set()
        return True

    async def _finish_stopped(self) -> None:
        for pull in [p for p in self._pulls.values() if p.stopping]:
            if pull.running or pull.request_open_s() > 0:
                continue           # its last pull may still bring messages
            if pull.stop_reason == "release" and self._inflight_of(pull.shard or 0):
                continue           # graceful: the worker settles what it started first
            await self._retire(pull)

    async def _retire(self, pull: Pull) -> None:
        """Nak what we pulled but never handed out, drop the subscription, free the lease."""
        assert pull.shard is not None
        mine = [m for m in self._backlog if m.subject == pull.subject]
        if mine:
            self._backlog = deque(m for m in self._backlog if m.subject != pull.subject)
        undelivered = mine + pull.leftovers()
        self.gave_back(self._deliveries_of(undelivered))
        await self._release(undelivered)
        await pull.unsubscribe()
        self._pulls.pop(pull.durable, None)
        if pull.stop_reason == "release" and self._leases is not None:
            await self._leases.release(pull.shard)
        log.info("shard_stopped", shard=pull.shard, worker=self.worker_id, reason=pull.stop_reason,
                 released_undelivered=len(undelivered),
                 took_s=round(time.monotonic() - pull.stopped_at, 3))

    async def _open_owned(self) -> None:
        """A pull for every owned shard that has none yet (new claims, or after a new
        connection object); a failure is retried on the next tick."""
        assert self._leases is not None
        missing = [s for s, lease in self._leases.owned.items()
                   if not lease.releasing and shard_consumer_name(self.cfg, s) not in self._pulls]
        results = await asyncio.gather(*(self._open_shard(s) for s in missing), return_exceptions=True)
        for shard, result in zip(missing, results):
            if isinstance(result, BaseException):
                log.warning("shard_subscribe_failed", shard=shard, worker=self.worker_id,
                            error=repr(result))

    async def _open_shard(self, shard: int) -> None:
        assert self._js is not None
        name = shard_consumer_name(self.cfg, shard)
        info, _ = await ensure_consumer_info(self._js, self.cfg, shard_consumer_config(self.cfg, shard))
        psub = await self._js.pull_subscribe_bind(durable=name, stream=STREAM)
        if self._leases is None or shard not in self._leases.owned or name in self._pulls:
            await psub.unsubscribe()     # lost it (or opened twice) while we were subscribing
            return
        pull = Pull(name, shard_subject(shard, self.cfg.queue.shards), shard, psub)
        pull.pending = info.num_pending or 0     # a backlog: busy from its first pull
        self._pulls[name] = pull
        self._start_pull(pull)
