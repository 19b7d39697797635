"""Transport subclasses with the extra moves only tests need (never shipped in crawld)."""
from __future__ import annotations

import asyncio
from typing import Any

from nats.aio.msg import Msg

from crawld.transports.base import Settlement
from crawld.transports.jetstream import RETRYABLE, JetStreamTransport


class CrashingJetStreamTransport(JetStreamTransport):
    """A JetStream transport that can die like a killed worker, and counts the settlements
    the server has answered (what a crash at this moment can no longer turn into a
    duplicate)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answered: list[int] = []    # stream seqs; appended on the loop thread only

    async def _reply(self, msg: Msg, payload: bytes, settlement: Settlement) -> None:
        await super()._reply(msg, payload, settlement)
        self.answered.append(msg.metadata.sequence.stream)

    def abort(self) -> None:
        """Close without releasing anything, as a crash would: the server redelivers the
        unsettled deliveries after AckWait (close() would nak them at once)."""
        if self._closed:
            return
        self._consuming = False
        self._closed = True
        self._held.clear()
        self._backlog.clear()
        try:
            if self._nc is not None:
                self._run(asyncio.wait_for(self._nc.close(), 2.0))
        except RETRYABLE:
            pass
        finally:
            self._finish_loop()
