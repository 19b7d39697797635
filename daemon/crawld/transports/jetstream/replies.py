"""Requests answered on one wildcard inbox of the transport's connection.

Every settle is a request (the double ack) and so is every result event (its PubAck):
one or two per task. nats-py's ``request`` draws a fresh token from ``os.urandom`` (a
syscall) and wraps each wait in ``asyncio.wait_for``; here a counter names the reply
subject and one timer bounds the wait, as nats.go's async publish does. Same answers,
same timeout error (nats-py's, an ``asyncio.TimeoutError``).
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg


class Replies:
    def __init__(self) -> None:
        self._nc: Client | None = None
        self._prefix = ""
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._tokens = itertools.count(1)

    async def bind(self, nc: Client) -> None:
        """A new connection object: its own inbox; requests made on the old one fail now
        (nats-py keeps subscriptions across its own reconnects, not across objects)."""
        self._fail_all(nats.errors.ConnectionClosedError())
        prefix = nc.new_inbox()
        await nc.subscribe(prefix + ".*", cb=self._on_reply)
        self._nc, self._prefix = nc, prefix

    async def request(self, subject: str, payload: bytes, timeout: float,
                      headers: dict[str, Any] | None = None) -> Msg:
        nc = self._nc
        if nc is None or nc.is_closed:
            raise nats.errors.ConnectionClosedError
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Msg] = loop.create_future()
        self._waiting[token] = answer
        timer = loop.call_later(timeout, _time_out, answer)
        try:
            await nc.publish(subject, payload, reply=f"{self._prefix}.{token}", headers=headers)
            return await answer
        finally:
            timer.cancel()
            self._waiting.pop(token, None)

    async def _on_reply(self, msg: Msg) -> None:
        answer = self._waiting.get(msg.subject[len(self._prefix) + 1:])
        if answer is not None and not answer.done():
            answer.set_result(msg)

    def _fail_all(self, error: BaseException) -> None:
        for answer in self._waiting.values():
            if not answer.done():
                answer.set_exception(error)
        self._waiting.clear()


def _time_out(answer: asyncio.Future[Msg]) -> None:
    if not answer.done():
        answer.set_exception(nats.errors.TimeoutError())
