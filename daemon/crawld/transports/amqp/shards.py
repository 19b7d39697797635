"""Which shard queues this worker is the active consumer of, and handing extras over.

RabbitMQ's single active consumer picks the consumer that subscribed first and never tells
a consumer that it is the active one. A worker learns it owns a shard when the shard
delivers to it. Every ``BALANCE_EVERY_S`` it compares the shards that delivered lately
with its fair share of the shards that have work (busy shards / consumers of the
intake queue, i.e. live workers) and releases the surplus: it stops starting that shard's
deliveries (holding what still arrives), waits until none of that shard's tasks runs here
any more, then cancels and subscribes again at the back of the line, so the broker
activates the next worker, which does the same if that puts it above its share. Idle
shards cost nothing, so only shards with work are counted.

A shard counts as busy for ``ACTIVE_WINDOW_S`` after it was last seen with work: here, its
last delivery; elsewhere, the last balance round that found messages ready in its queue. A
shard queue empties long before its owner has run what it holds (up to a whole window), so
counting only "messages ready" made every worker see the others' shards go idle, its own
share look too large, and hand over shards with tasks still parked here: their sites then
stalled for the handover (500 sites, 2 x 256 threads: sites with nothing fetched for 5-7 s
and a tail of 3 s on a 10 s run).

"The next worker" is whoever subscribed to that shard queue earliest, not necessarily one
below its share: a shard could hop from full worker to full worker while a new one waits
empty. So a worker that holds its share **steps back** from the busy shards it does not
own (cancel and subscribe again, at most once per ``STEP_BACK_EVERY_S`` per queue; it is
only a standby there, so nothing is delivered or lost): the workers below their share,
which never step back, end up first in every line. When a worker joins (the intake's
consumer count grows) the ones at their share step back at once rather than on their
timer, so a restarted host gets its share within a balance round or two.

Pure bookkeeping, no pika: the transport calls it on its I/O thread.
"""
from __future__ import annotations

import math
import time
from typing import Callable

from crawld.config import Config
from crawld.fleet.partition import shard_window
from crawld.transports.amqp.topology import shard_queue_names
from crawld.transports.base import Delivery

BALANCE_EVERY_S = 2.0
FIRST_BALANCE_S = 1.0
ACTIVE_WINDOW_S = 10.0     # a shard that delivered within this long counts as ours
SETTLE_S = 0.2             # idle this long before the cancel: what was on the wire has arrived
STEP_BACK_EVERY_S = 10.0   # a worker at its share re-queues behind the others this often per shard


class Shards:
    def __init__(self, cfg: Config, clock=time.monotonic) -> None:
        self.queues = shard_queue_names(cfg)
        self._index = {queue: i for i, queue in enumerate(self.queues)}
        # Per-shard window: one site's shard never fills the worker's whole prefetch.
        self.prefetch = shard_window(cfg)
        self.releasing: dict[str, list[Delivery]] = {}
        self._idle_since: dict[str, float] = {}
        self._last_seen: dict[str, float] = {}
        self._waiting_seen: dict[str, float] = {}    # shard -> when its queue last had messages ready
        self._stepped_back: dict[str, float] = {}
        self._consumers_seen = 0
        self._clock = clock
        self._next_balance = clock() + FIRST_BALANCE_S
        self.acquired = 0          # shards that started delivering to this worker
        self.released = 0          # shards this worker handed to the next in line

    def hold(self, queue: str, delivery: Delivery, on_acquired: Callable[[int], None]) -> bool:
        """Note a delivery from ``queue``; True when the shard is being handed over and the
        delivery must wait (unstarted) to be given back. A shard that was not delivering
        here is announced to ``on_acquired`` first (politeness state of a handover)."""
        if queue not in self._index:
            return False        # the intake queue
        now = self._clock()
        last = self._last_seen.get(queue)
        if last is None or now - last >= ACTIVE_WINDOW_S:
            self.acquired += 1
            on_acquired(self._index[queue])
        self._last_seen[queue] = now
        held = self.releasing.get(queue)
        if held is None:
            return False
        held.append(delivery)
        return True

    def held_ids(self) -> set[int]:
        return {id(d) for held in self.releasing.values() for d in held}

    def active(self) -> list[int]:
        """Indices of the shards that delivered here lately and are not being released."""
        now = self._clock()
        return sorted(self._index[q] for q, t in self._last_seen.items()
                      if now - t < ACTIVE_WINDOW_S and q not in self.releasing)

    def balance_due(self) -> bool:
        now = self._clock()
        if now < self._next_balance:
            return False
        self._next_balance = now + BALANCE_EVERY_S
        return True

    def start_releases(self, consumers: int, waiting: set[str]) -> list[str]:
        """The shards beyond ceil(busy shards / consumers) this worker should give away now,
        least recently active first. ``waiting``: shard queues with messages ready; with the
        ones active here they are the busy shards of the whole fleet."""
        if consumers <= 1:
            return []
        active = [self.queues[i] for i in self.active()]
        surplus = len(active) - self._fair(consumers, self._busy(waiting), active)
        if surplus <= 0:
            return []
        chosen = sorted(active, key=lambda q: self._last_seen[q])[:surplus]
        for queue in chosen:
            self.releasing[queue] = []
        return chosen

    def step_backs(self, consumers: int, waiting: set[str]) -> list[str]:
        """Busy shards another worker serves, to re-queue behind the others on, when this
        worker already holds its fair share (empty otherwise: it wants the next one)."""
        if consumers > self._consumers_seen:
            self._stepped_back.clear()      # someone joined: make way for it now
        self._consumers_seen = consumers
        active = [self.queues[i] for i in self.active()]
        if consumers <= 1 or len(active) < self._fair(consumers, self._busy(waiting), active):
            return []
        now = self._clock()
        due = sorted(q for q in waiting if q not in active and q not in self.releasing
                     and now - self._stepped_back.get(q, -STEP_BACK_EVERY_S) >= STEP_BACK_EVERY_S)
        for queue in due:
            self._stepped_back[queue] = now
        return due

    def _busy(self, waiting: set[str]) -> set[str]:
        """Shard queues seen with messages ready within ACTIVE_WINDOW_S (``waiting`` now)."""
        now = self._clock()
        for queue in waiting:
            self._waiting_seen[queue] = now
        return {q for q, t in self._waiting_seen.items() if now - t < ACTIVE_WINDOW_S}

    @staticmethod
    def _fair(consumers: int, busy: set[str], active: list[str]) -> int:
        return math.ceil(len(busy | set(active)) / consumers)

    def ready_to_release(self, inflight_by_queue: dict[str, int]) -> list[str]:
        """Releasing shards with nothing of theirs running here for SETTLE_S: safe to hand
        over (deliveries still on the wire at a cancel come back flagged as redelivered)."""
        now = self._clock()
        ready = []
        for queue in self.releasing:
            if inflight_by_queue.get(queue):
                self._idle_since.pop(queue, None)
            elif now - self._idle_since.setdefault(queue, now) >= SETTLE_S:
                ready.append(queue)
        return ready

    def finish_release(self, queue: str) -> list[Delivery]:
        self._idle_since.pop(queue, None)
        held = self.releasing.pop(queue, [])
        self._last_seen.pop(queue, None)
        self.released += 1
        return held

    def reset(self) -> None:
        """Consumers gone (stop, lost connection): nothing is owned or being released."""
        self.releasing.clear()
        self._idle_since.clear()
        self._last_seen.clear()
        self._waiting_seen.clear()
