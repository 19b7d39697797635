"""JetStream fast-ingest batches: one flow ack per ``flow`` tasks instead of a PubAck each.

nats-server 2.14+ stores each message of a fast batch as it arrives (the stream needs
``allow_batched``) and, in ``fail`` gap mode, answers ``{"type":"ack","seq":N,...}``
meaning batch messages 1..N are in the stream; the last message ends the batch and gets
an ordinary PubAck. ``Nats-Msg-Id`` deduplication applies per message as usual. The
control state rides on the reply subject (ADR-50):
``<inbox>.<batch>.<flow>.fail.<seq>.<op>.$FI`` with op 0 = start, 1 = append, 2 = commit.

The publisher falls back to per-message PubAcks (``AckWindow``) when the first answer is
not a flow ack: the stream lacks ``allow_batched`` (a stream made by an older crawld and
not declared now) or the server predates fast batches. Nothing is lost either way: a task
counts as confirmed only once an ack covers it; the rest are reported failed and the
outbox sends them again (the id keeps that from queueing them twice).
"""
from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any, Awaitable, Callable

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from crawld.task import Task
from crawld.transports.base import ProgressCallback, PublishReport
from crawld.transports.jetstream.connection import unsubscribe_quietly, wait_set
from crawld.transports.jetstream.topology import MSG_ID_HEADER

OUTSTANDING_ACKS = 2        # keep sending the next flow's worth while the server stores one
MAX_FLOW = 65535            # the server's ack interval is a uint16
START, APPEND, COMMIT, PING = 0, 1, 2, 4
PING_SLICES = 3             # a silent third of the timeout pings the batch

Item = tuple[str, Task, str]      # (subject, task, Nats-Msg-Id)


class FastBatch:
    """Sends ``items`` as one fast batch; ``run`` returns how many it dealt with (confirmed
    or reported failed). Fewer than all means the server answered the first message with
    something other than a flow ack: the caller sends the rest with per-message PubAcks."""

    def __init__(self, nc: Client, flow: int, timeout_s: float, report: PublishReport,
                 progress: ProgressCallback | None, total: int) -> None:
        self.nc = nc
        self.flow = max(1, min(flow, MAX_FLOW))
        self.timeout_s = timeout_s
        self.report = report
        self.progress = progress
        self.total = total
        self.acks_heard = 0
        self.pings = 0
        self._items: list[Item] = []
        self._sent = 0                # highest batch sequence published
        self._confirmed = 0           # items[:_confirmed] are in report.confirmed
        self._acked = 0               # highest batch sequence a flow ack covered
        self._interval = self.flow    # the server may lower it on any flow ack
        self._final: dict[str, Any] | None = None   # the commit's PubAck, or an error that ended the batch
        self._first: dict[str, Any] | None = None   # the answer to the start message
        self._heard = asyncio.Event()
        batch = secrets.token_hex(16)
        self._inbox = f"{nc.new_inbox()}.{batch}"
        self._reply = f"{self._inbox}.{self.flow}.fail."
        self._send = raw_sender(nc)

    async def run(self, items: list[Item]) -> int:
        self._items = items
        sub = await self.nc.subscribe(self._inbox + ".>", cb=self._on_reply)
        try:
            return await self._run(items)
        finally:
            await unsubscribe_quietly(sub)

    async def _run(self, items: list[Item]) -> int:
        if not await self._start(items[0]):
            return self._fallback()
        sent = await self._send_rest(items)
        # Once the commit is out there is no batch left to ping: its PubAck ends the wait.
        while sent == len(items) and self._final is None and await self._hear():
            pass
        self._settle(sent)
        return len(items)

    async def _start(self, item: Item) -> bool:
        """Send the first message alone and wait for the server's verdict on batching."""
        if not await self._publish(1, START, item):
            return False
        while self._first is None and await self._hear():
            pass
        return self._first is not None and self._first.get("type") == "ack"

    def _fallback(self) -> int:
        """Not batching: what became of the first message decides where per-message
        publishing resumes."""
        first = self._first
        if first is None:                         # silence: nothing more to try now
            self._settle(1)
            return len(self._items)
        if "error" in first or "stream" not in first:
            return 0                              # not stored: resend it with the rest
        self._confirm_to(1)                       # an older server stored it as a plain publish
        return 1

    async def _send_rest(self, items: list[Item]) -> int:
        """Append items 2..n (the last one commits) while at most OUTSTANDING_ACKS flows
        are unanswered; returns how many were sent in all."""
        last = len(items)
        for seq in range(2, last + 1):
            while self._final is None and self._acked + self._interval * OUTSTANDING_ACKS <= seq:
                if not await self._hear(ping=True):
                    return seq - 1
            if self._final is not None:           # the server ended the batch early
                return seq - 1
            if not await self._publish(seq, COMMIT if seq == last else APPEND, items[seq - 1]):
                return seq - 1
        return last

    async def _publish(self, seq: int, op: int, item: Item) -> bool:
        subject, task, msg_id = item
        try:
            await self._send(subject, task.to_body(), f"{self._reply}{seq}.{op}.$FI", msg_id)
            self._sent = seq
            return True
        except (nats.errors.Error, OSError) as exc:
            self._fail_from(seq - 1, repr(exc), stop=seq)
            return False

    async def _hear(self, ping: bool = False) -> bool:
        """Wait for the next answer; False after ``timeout_s`` of silence. Each silent
        slice of it pings the batch, and the server answers with its latest flow ack: a
        lost ack costs a slice, not the batch (the ping itself stores nothing)."""
        self._heard.clear()
        for left in range(PING_SLICES - 1, -1, -1):
            if await wait_set(self._heard, self.timeout_s / PING_SLICES):
                return True
            if ping and left:
                await self._ping()
        return False

    async def _ping(self) -> None:
        try:
            subject = self._items[self._sent - 1][0]     # any subject of the batch's stream
            await self.nc.publish(subject, b"", reply=f"{self._reply}{self._sent}.{PING}.$FI")
            self.pings += 1
        except (nats.errors.Error, OSError):
            pass                                  # the wait ends in silence and says so

    async def _on_reply(self, msg: Msg) -> None:
        self.acks_heard += 1
        try:
            answer = json.loads(msg.data)
        except ValueError:
            answer = {"error": {"description": f"unreadable answer: {msg.data[:200]!r}"}}
        if self._first is None:
            self._first = answer
        kind = answer.get("type")
        if kind == "ack":
            self._on_flow_ack(answer)
        elif kind != "gap" and self._final is None:
            # The first PubAck ends the batch (a gap in fail mode is followed by one); what
            # was in flight behind an error is answered "batch unknown", not the cause.
            self._final = answer
        self._heard.set()

    def _on_flow_ack(self, answer: dict[str, Any]) -> None:
        self._interval = max(1, int(answer.get("msgs") or self._interval))
        seq = int(answer.get("seq") or 0)
        if seq > self._acked:                     # an ack for N covers every ack before it
            self._acked = seq
            self._confirm_to(seq)

    def _settle(self, sent: int) -> None:
        """Items 1..sent went out; the final PubAck (if any) decides the unacked ones."""
        final = self._final
        if final is not None and "error" not in final and sent == len(self._items):
            self._confirm_to(sent)
            return
        reason = self._reason(final)
        self._fail_from(self._confirmed, reason, stop=sent)
        self._fail_from(sent, f"not sent: {reason}")

    def _reason(self, final: dict[str, Any] | None) -> str:
        if final is None:
            return f"no PubAck within {self.timeout_s:g}s"
        if "error" in final:
            return rejection(final["error"])
        return f"batch ended early: {json.dumps(final)[:200]}"

    def _confirm_to(self, n: int) -> None:
        n = min(n, len(self._items))
        if n <= self._confirmed:
            return
        self.report.confirmed.extend(task.task_id for _, task, _ in self._items[self._confirmed:n])
        self._confirmed = n
        if self.progress is not None:
            self.progress(n, self.total)

    def _fail_from(self, start: int, reason: str, stop: int | None = None) -> None:
        for _, task, _ in self._items[max(start, self._confirmed):stop]:
            self.report.failed.setdefault(task.task_id, reason)


def rejection(error: dict[str, Any]) -> str:
    """The failure reason for a PubAck's ``error`` object, as the outbox records it."""
    return f"rejected: {error.get('description')} (err_code {error.get('err_code')})"


Sender = Callable[[str, bytes, str, str], Awaitable[None]]
HEADER_START = b"NATS/1.0\r\n" + MSG_ID_HEADER.encode() + b": "   # then the id, CRLF CRLF


def raw_sender(nc: Client) -> Sender:
    """``nc.publish(subject, body, reply, headers={Nats-Msg-Id: id})`` without nats-py's
    per-call header validation and encoding (a third of the publisher's CPU per message):
    the HPUB frame is written once here. Uses the client's own outgoing buffer, so it only
    applies while connected and on a client that has one; otherwise the public call."""
    public = _public_sender(nc)
    if not all(hasattr(nc, name) for name in ("_send_command", "_flush_queue", "_flush_pending")):
        return public
    limit = nc.max_payload

    async def send(subject: str, body: bytes, reply: str, msg_id: str) -> None:
        header = HEADER_START + msg_id.encode() + b"\r\n\r\n"
        size = len(header) + len(body)
        if not nc.is_connected or size > limit or "\n" in msg_id or "\r" in msg_id:
            await public(subject, body, reply, msg_id)   # buffering rules and errors as usual
            return
        await nc._send_command(b"HPUB %s %s %d %d\r\n%s%s\r\n" % (
            subject.encode(), reply.encode(), len(header), size, header, body))
        if nc._flush_queue is not None and nc._flush_queue.empty():
            await nc._flush_pending()     # wakes the flusher, as nc.publish does
    return send


def _public_sender(nc: Client) -> Sender:
    async def send(subject: str, body: bytes, reply: str, msg_id: str) -> None:
        await nc.publish(subject, body, reply=reply, headers={MSG_ID_HEADER: msg_id})
    return send
