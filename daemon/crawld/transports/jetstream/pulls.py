"""One pull subscription of the transport: the intake durable or a shard durable."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext


@dataclass
class Pull:
    """A bound durable and the task pulling from it.

    ``stopping``: released or fenced, pull no more; ``deadline``: when our last pull
    request expires on the server (naking before that would hand messages right back to
    this subscription); ``pending``: what the server said is left after the last message
    we got (0: the shard is drained, it only gets probes of one).
    """

    durable: str
    subject: str
    shard: int | None             # None: the intake durable
    psub: Any
    task: asyncio.Task[None] | None = None
    deadline: float = 0.0
    stopping: bool = False
    rebind: bool = False
    pending: int = 0              # shards start probing; see ShardMixin._allocate
    stopped_at: float = 0.0
    stop_reason: str = ""         # "release" (rebalance, graceful) or "lost" (fenced)
    turn: float = 0.0             # when this shard last got slots: round robin
    due_at: float = float("inf")  # when a message we naked with a delay comes back
    reserved: int = 0             # worker slots granted to this pull's next/current request
    expiry: float = 1.0           # of the granted request
    waiting: bool = False         # wants slots
    busy_at: float = -float("inf")  # when it last had work (ShardMixin._busy_shard)
    granted: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        take_queued_at_once(getattr(self.psub, "_sub", None))

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start_request(self, expiry_s: float) -> None:
        self.deadline = time.monotonic() + expiry_s + 0.05

    def request_open_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def leftovers(self) -> list[Msg]:
        """Messages that arrived for an expired pull but were never returned by fetch()."""
        queue = getattr(getattr(self.psub, "_sub", None), "_pending_queue", None)
        out: list[Msg] = []
        while queue is not None and not queue.empty():
            msg = queue.get_nowait()
            if msg.reply and not JetStreamContext.is_status_msg(msg):
                out.append(msg)
        return out

    async def wait_grant(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.granted.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self.granted.clear()

    async def unsubscribe(self) -> None:
        try:
            await self.psub.unsubscribe()
        except Exception:   # already gone with its connection: nothing to undo
            pass


def take_queued_at_once(sub: Any) -> None:
    """nats-py's ``Subscription.next_msg`` draws a uuid4 (``os.urandom``), starts a Task and
    ``wait_for`` starts another, with a timer, for every message, even one already queued;
    ``fetch`` calls it once per message of a pull and once more for the closing status. On
    our pull subscriptions a queued message is taken at once, with the same bookkeeping;
    only an empty queue waits (nats-py's own call, cancelled by its close as before)."""
    queue = getattr(sub, "_pending_queue", None)
    if queue is None or not hasattr(sub, "_pending_size") or not hasattr(sub, "_conn"):
        return      # another nats-py inside: keep its next_msg as it is
    waiting = sub.next_msg

    async def next_msg(timeout: float | None = 1.0) -> Msg:
        if sub._conn.is_closed or queue.empty():
            return await waiting(timeout)
        msg = queue.get_nowait()
        sub._pending_size -= len(msg.data)
        queue.task_done()
        return msg

    sub.next_msg = next_msg
