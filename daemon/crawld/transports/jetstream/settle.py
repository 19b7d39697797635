"""The broker side of a finished delivery: ack, term, nak(delay), dead-letter + term.

Terminal replies (ack, nak, term) are sent as requests ("double ack"): the server answers
once it has recorded them, so ``pending_settlements() == 0`` means the broker has them.
An ack or term whose settlement carries a result event follows the event's PubAck
(events.py); without one the delivery is given back (nak) instead.

Unlike AMQP delivery tags, JetStream acks are published to the message's reply
subject (``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>...``), which does not belong
to a connection: an ack sent after nats-py transparently reconnected is still valid and
saves a duplicate fetch. Only deliveries from a connection object we gave up on and
replaced are dropped on settle (the server redelivers them after AckWait).
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from crawld.config import Config
from crawld.transports.base import EVENT_TIMEOUT_S, Action, Delivery, Settlement
from crawld.transports.common import (Generations, PendingSettlements, SettleInbox, complete, dispatch,
                                      event_outcome, forward_headers, task_id_of)
from crawld.transports.jetstream.connection import API_TIMEOUT_S, log
from crawld.transports.jetstream.events import publish_event
from crawld.transports.jetstream.replies import Replies
from crawld.transports.jetstream.topology import MSG_ID_HEADER, STREAM, WORK_PREFIX, dead_subject

DEAD_RETRY_DELAY_S = 5.0     # nak delay when the dead-letter publish failed

Handler = Callable[["Held", Settlement], Awaitable[None]]


@dataclass
class Held:
    """A delivery handed to the worker and not yet settled."""

    msg: Msg
    delivery: Delivery
    generation: int
    last_signal: float          # monotonic time of delivery or of the last in_progress
    settling: bool = False


class SettleMixin:
    """Settling for JetStreamTransport (consumer.py owns the attributes declared here)."""

    cfg: Config
    _loop: asyncio.AbstractEventLoop
    _announcing: int            # settles waiting for their event's PubAck
    _replies: Replies
    event_settled: Callable[[Delivery, Settlement], None]
    _nc: Client | None
    _js: JetStreamContext | None
    _held: dict[int, Held]
    _generations: Generations
    _pending: PendingSettlements
    _settle_tasks: set[asyncio.Task[None]]
    _inbox: SettleInbox
    _wake: asyncio.Event
    _handlers: Mapping[Action, Handler]
    connected: bool

    def _settle_handlers(self) -> Mapping[Action, Handler]:
        """Built once per transport (bound methods); ``complete`` checks every Action."""
        return complete({Action.ACK: self._ack, Action.SKIP: self._term, Action.RETRY: self._retry,
                         Action.RELEASE: self._give_back, Action.DEAD: self._dead_letter,
                         Action.DEFER: self._retry})   # nak(delay); the handler forgave it

    def settle(self, delivery: Delivery, settlement: Settlement) -> None:
        """Thread-safe: the broker side runs on the loop during the next poll()."""
        # RuntimeError: the loop is closed, the transport is gone
        self._pending.hand_off(lambda: self._enqueue(delivery, settlement), delivery, settlement,
                               (RuntimeError,), "transport closed")

    def _enqueue(self, delivery: Delivery, settlement: Settlement) -> None:
        """Into the inbox, and a wake-up for the loop unless one is on its way."""
        if self._inbox.put([(delivery, settlement)]):
            try:
                self._loop.call_soon_threadsafe(self._drain_inbox)
            except RuntimeError:
                pass    # the loop closed just now: close() drops what the inbox holds, this one too

    def _drop_inbox(self) -> None:
        """After the loop closed: what no drain will settle is given up (the server
        redelivers it after AckWait), and no longer pending; later settles are refused."""
        for delivery, settlement in self._inbox.close():
            self._pending.done()
            log.warning("settle_dropped", transport="jetstream", reason="transport closed",
                        message_id=delivery.message_id, action=settlement.action.value)

    def _drain_inbox(self) -> None:
        for delivery, settlement in self._inbox.take():
            self._spawn(self._settle_now(delivery, settlement))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = self._loop.create_task(coro)  # type: ignore[arg-type]
        self._settle_tasks.add(task)
        task.add_done_callback(self._settle_tasks.discard)

    def _current_held(self, delivery: Delivery, settlement: Settlement) -> Held | None:
        """The held entry to settle, or None (logged) when settling it would be wrong:
        released at close, from a replaced connection, or settled twice -- the server
        already has (or will redeliver) it."""
        held = self._held.get(id(delivery.handle))
        if held is not None and held.msg is delivery.handle and not held.settling \
                and not self._generations.is_stale(held.generation):
            return held
        log.info("stale_delivery_dropped", transport="jetstream", message_id=delivery.message_id,
                 stream_seq=delivery.stream_seq, action=settlement.action.value,
                 reason="settled twice" if held is not None and held.settling else "unknown delivery",
                 generation=self._generations.current)
        return None

    async def _settle_now(self, delivery: Delivery, settlement: Settlement) -> None:
        try:
            held = self._current_held(delivery, settlement)
            if held is None:
                return
            held.settling = True    # stays held (and in progress) until the broker has it
            try:
                await dispatch(self._handlers, settlement, held)
            finally:
                self._held.pop(id(held.msg), None)
        except Exception as exc:   # never lose the task silently: it comes back after AckWait
            log.warning("settle_failed", transport="jetstream", message_id=delivery.message_id,
                        action=settlement.action.value, error=repr(exc))
        finally:
            self._pending.done()
            self._wake.set()

    async def _ack(self, held: Held, settlement: Settlement) -> None:
        if await self._announced(held, settlement):
            await self._reply(held.msg, Msg.Ack.Ack, settlement)

    async def _term(self, held: Held, settlement: Settlement) -> None:
        if await self._announced(held, settlement):
            await self._reply(held.msg, Msg.Ack.Term, settlement)

    async def _announced(self, held: Held, settlement: Settlement) -> bool:
        """True when there is no event or it is PubAcked; else the delivery was given back
        (its redelivery, a duplicate, announces the stored row again)."""
        if settlement.event is None:
            return True
        js = self._js
        if js is None:
            raise nats.errors.ConnectionClosedError
        self._announcing += 1
        try:
            error = await publish_event(js, self._replies.request, self.cfg, settlement.event,
                                        EVENT_TIMEOUT_S)
        finally:
            self._announcing -= 1
        outcome = event_outcome(held.delivery, settlement, error, log, "jetstream")
        self.event_settled(held.delivery, outcome)
        if error is None:
            return True
        await self._give_back(held, outcome)
        return False

    async def _retry(self, held: Held, settlement: Settlement) -> None:
        await self._reply(held.msg, nak_payload(settlement.delay_s), settlement)
        self._comes_back(held.msg.subject, settlement.delay_s)

    def _comes_back(self, subject: str, delay_s: float) -> None:
        """A delayed redelivery is due on ``subject`` (the shard transport probes it then)."""

    async def _give_back(self, held: Held, settlement: Settlement) -> None:
        await self._reply(held.msg, Msg.Ack.Nak, settlement)

    async def _reply(self, msg: Msg, payload: bytes, settlement: Settlement) -> None:
        """Double ack: the server answers once it has recorded the ack/nak/term, so
        ``pending_settlements() == 0`` means the broker has every settlement (drain,
        status and reconciliation see consistent numbers). While disconnected the
        request stays in nats-py's buffer and is sent after the reconnect; if it is lost
        anyway the server redelivers: a duplicate, never a loss."""
        nc = self._nc
        if nc is None or nc.is_closed:
            raise nats.errors.ConnectionClosedError
        try:
            await self._replies.request(msg.reply, payload, API_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("settle_unconfirmed", transport="jetstream", action=settlement.action.value,
                        stream_seq=msg.metadata.sequence.stream, connected=self.connected)
        msg._ackd = True   # keep nats-py's own guard (MsgAlreadyAckdError) consistent

    async def _dead_letter(self, held: Held, settlement: Settlement) -> None:
        """Publish to crawl.dead.<source>, wait for the PubAck, only then term the original."""
        if self._js is None:
            raise nats.errors.ConnectionClosedError
        delivery, msg = held.delivery, held.msg
        task_id = task_id_of(delivery, settlement, fallback=f"{STREAM}-seq-{delivery.stream_seq}")
        subject = dead_subject(_source(delivery, settlement))
        try:
            ack = await self._js.publish(subject, delivery.body, timeout=API_TIMEOUT_S,
                                         headers=_dead_headers(delivery, settlement, task_id))
        except (asyncio.TimeoutError, nats.errors.Error, OSError) as exc:
            log.error("dead_letter_failed", task_id=task_id, subject=subject, attempt=delivery.attempt,
                      error=repr(exc), retry_in_s=DEAD_RETRY_DELAY_S)
            # Keep it in CRAWL (nothing is lost); the worker dead-letters it again later.
            await self._reply(msg, nak_payload(DEAD_RETRY_DELAY_S), settlement)
            return
        await self._reply(msg, Msg.Ack.Term, settlement)
        log.info("dead_lettered", task_id=task_id, subject=subject, dead_seq=ack.seq,
                 duplicate=bool(ack.duplicate), attempt=delivery.attempt, reason=settlement.reason)


def nak_payload(delay_s: float) -> bytes:
    """``-NAK {"delay": ns}``: a delayed redelivery outside the main path (no sleeping)."""
    if delay_s <= 0:
        return Msg.Ack.Nak
    return Msg.Ack.Nak + b" " + json.dumps({"delay": int(delay_s * 1e9)}).encode()


def _dead_headers(delivery: Delivery, settlement: Settlement, task_id: str) -> dict[str, str]:
    """The original's headers minus the server's own (``Nats-*``), plus ours; the id makes a
    second dead-letter of the same attempt a duplicate the dead stream drops."""
    headers: dict[str, Any] = {k: v for k, v in delivery.headers.items() if not k.startswith("Nats-")}
    headers.update(forward_headers(delivery, settlement, delivery.attempt))
    headers[MSG_ID_HEADER] = f"{task_id}:dead:{delivery.attempt}"
    return {k: str(v) for k, v in headers.items()}   # NATS header values are strings


def _source(delivery: Delivery, settlement: Settlement) -> str:
    task = settlement.task
    if task is not None and task.source:
        return task.source
    token = delivery.origin.rsplit(".", 1)[-1] if delivery.origin.startswith(WORK_PREFIX) else ""
    return token or "unknown"
