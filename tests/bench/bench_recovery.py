"""Recovery: SIGKILL of a worker -> its deliveries done by another; SIGTERM drain time.

    python tests/bench/bench_recovery.py [--quick]

Standalone ``crawld worker`` processes (no supervisor, so no respawn muddles the timing):

* kill: worker A takes 16 tasks whose pages hang on the first hit (``/hang-once/30/...``),
  worker B connects idle, A is SIGKILLed. Measured: from the kill to the first and to the
  last of A's 16 tasks stored by B (the results' fetched_at; B's second hits answer at
  once). AMQP: the broker requeues when A's TCP connection dies. JetStream: the server
  redelivers after AckWait (queue.ack_wait_s = 6 here; A sent in_progress every 2 s).
* drain: worker A holds 16 in-flight fetches of 2 s pages and 16 more tasks wait in the
  broker; SIGTERM mid-fetch. Measured: SIGTERM -> exit, the part of it spent finishing
  the fetches (last fetched_at - SIGTERM) and the rest (overhead); then whether the 16
  in-flight results were stored once each and how many messages came back redelivered.
"""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from typing import Any

from benchlib import (Env, Section, Table, amqp_delete_setup, amqp_depth, amqp_publish_raw, bench_main,
                      crawld_setup, db_count, db_rows, js_publish_core, run_section, start_worker,
                      stop_proc, url_bodies, wait_log_event, wait_rows, wait_until)

KEY = "recovery"
COMMAND = "python tests/bench/bench_recovery.py"
TASKS = 16
ACK_WAIT_S = 6.0


def js_consumer(url: str, durable: str) -> dict[str, int]:
    import nats

    async def main() -> dict[str, int]:
        nc = await nats.connect(url)
        try:
            info = await nc.jetstream().consumer_info("CRAWL", durable)
            return {"pending": info.num_pending, "ack_pending": info.num_ack_pending,
                    "redelivered": info.num_redelivered}
        finally:
            await nc.close()
    return asyncio.run(main())


def publish(env: Env, setup: Any, transport: str, urls: list[str], nats_url: str = "") -> None:
    if transport == "amqp":
        amqp_publish_raw(env.rabbit.url, setup.queue, url_bodies(urls))
    else:
        js_publish_core(nats_url, "crawl.url.default", url_bodies(urls))


def held_by_worker(env: Env, setup: Any, transport: str, nats_url: str, ready: int, unacked: int) -> bool:
    if transport == "amqp":
        return amqp_depth(env.rabbit.url, setup.queue) == ready
    info = js_consumer(nats_url, setup.queue)
    return info["pending"] == ready and info["ack_pending"] == unacked


def publish_held_by_a(env: Env, setup: Any, transport: str, urls: list[str], nats_url: str) -> None:
    """Publish while only worker A runs, and wait until A holds (prefetched) every task."""
    publish(env, setup, transport, urls, nats_url)
    wait_until(lambda: held_by_worker(env, setup, transport, nats_url, 0, len(urls)), 30,
               what="worker A to hold every task")


def start_connected_worker(env: Env, setup: Any, tag: str) -> subprocess.Popen:
    """A foreground worker that has connected to the broker (and so is consuming)."""
    proc = start_worker(env, setup, tag)
    if not wait_log_event(setup.dir / f"worker-{tag}.log", "broker_connected", 30):
        raise RuntimeError(f"worker {tag.upper()} did not connect ({setup.dir})")
    return proc


def kill_case(env: Env, transport: str) -> dict[str, Any]:
    nats = env.new_nats() if transport == "jetstream" else None
    nats_url = nats.url if nats else ""
    setup = crawld_setup(env, "kill", transport=transport, broker_url=nats_url or None,
                         queue={"ack_wait_s": ACK_WAIT_S})
    try:
        a = start_connected_worker(env, setup, "a")
        urls = [f"{env.site}/hang-once/30/{setup.queue}/{i}" for i in range(TASKS)]
        publish_held_by_a(env, setup, transport, urls, nats_url)
        b = start_connected_worker(env, setup, "b")
        time.sleep(0.5)                      # B is idle and consuming
        killed = time.time()
        a.send_signal(signal.SIGKILL)
        a.wait(10)
        progress = wait_rows(setup.db, TASKS, time.perf_counter(), timeout=ACK_WAIT_S * 3 + 30)
        stop_proc(b, timeout=30)
        times = [r[0] for r in db_rows(setup.db, "SELECT fetched_at FROM results")]
        attempts = db_rows(setup.db, "SELECT COALESCE(MAX(attempts), 0) FROM results")[0][0]
        return {"stored": progress.final, "first": min(times) - killed if times else None,
                "last": max(times) - killed if times else None, "max_attempts": attempts}
    finally:
        if nats:
            env.drop_nats(nats)
        else:
            amqp_delete_setup(setup)


def drain_case(env: Env, transport: str, page_s: float = 2.0) -> dict[str, Any]:
    nats = env.new_nats() if transport == "jetstream" else None
    nats_url = nats.url if nats else ""
    setup = crawld_setup(env, "drain", transport=transport, broker_url=nats_url or None,
                         queue={"ack_wait_s": 60})
    try:
        a = start_connected_worker(env, setup, "a")
        urls = [f"{env.site}/slow/{page_s:g}/{setup.queue}/{i}" for i in range(TASKS)]
        publish_held_by_a(env, setup, transport, urls, nats_url)
        publish(env, setup, transport, [f"{env.site}/fast/{setup.queue}/extra{i}" for i in range(TASKS)],
                nats_url)
        time.sleep(0.5)                      # fetches well under way, extras waiting in the broker
        termed = time.time()
        t0 = time.perf_counter()
        a.send_signal(signal.SIGTERM)
        code = a.wait(60)
        drain_s = time.perf_counter() - t0
        stored = db_count(setup.db)
        last = db_rows(setup.db, "SELECT MAX(fetched_at) FROM results")[0][0]
        finishing = (last - termed) if last else None
        if transport == "amqp":
            waiting = amqp_depth(env.rabbit.url, setup.queue)
            redelivered = _amqp_redelivered(env, setup.queue, waiting)
        else:
            info = js_consumer(nats_url, setup.queue)
            waiting, redelivered = info["pending"], info["redelivered"]
        writes = db_rows(setup.db, "SELECT COALESCE(MAX(writes), 0) FROM results")[0][0]
        return {"exit": code, "drain_s": drain_s, "finishing_s": finishing,
                "overhead_s": (drain_s - finishing) if finishing is not None else None,
                "stored": stored, "waiting": waiting, "redelivered": redelivered, "max_writes": writes}
    finally:
        if nats:
            env.drop_nats(nats)
        else:
            amqp_delete_setup(setup)


def _amqp_redelivered(env: Env, queue: str, count: int) -> int:
    """basic_get every waiting message (then requeue nothing: the queue is deleted next)."""
    import pika
    conn = pika.BlockingConnection(pika.URLParameters(env.rabbit.url))
    try:
        ch = conn.channel()
        flagged = 0
        for _ in range(count):
            method, _props, _body = ch.basic_get(queue, auto_ack=True)
            if method is None:
                break
            flagged += bool(method.redelivered)
        return flagged
    finally:
        conn.close()


def measure(env: Env, quick: bool, section: Section) -> None:
    kill = Table(f"SIGKILL of worker A holding {TASKS} deliveries; idle worker B takes over",
                 ["transport", "stored by B", "kill -> first stored s", "kill -> all stored s",
                  "max attempt", "bound by"])
    for transport in ("amqp", "jetstream"):
        r = kill_case(env, transport)
        bound = "TCP close -> requeue" if transport == "amqp" else f"AckWait {ACK_WAIT_S:g} s (in_progress every {ACK_WAIT_S / 3:g} s)"
        kill.add(transport, f"{r['stored']}/{TASKS}", r["first"], r["last"], r["max_attempts"], bound)
        section.data[f"kill_{transport}"] = r["last"]
    drain = Table(f"SIGTERM with {TASKS} in-flight 2 s fetches and {TASKS} tasks waiting in the broker",
                  ["transport", "exit", "SIGTERM -> exit s", "finishing fetches s", "overhead s",
                   "in-flight stored", "max writes/row", "left in broker", "came back redelivered"])
    for transport in ("amqp", "jetstream"):
        r = drain_case(env, transport)
        drain.add(transport, r["exit"], r["drain_s"], r["finishing_s"], r["overhead_s"], f"{r['stored']}/{TASKS}",
                  r["max_writes"], r["waiting"], r["redelivered"])
        section.data[f"drain_{transport}"] = r["drain_s"]
        section.data[f"drain_overhead_{transport}"] = r["overhead_s"]
    section.tables += [kill, drain]
    section.notes.append("max attempt: AMQP counts our attempt header (a crash redelivery keeps it); "
                         "JetStream shows num_delivered, so 2 is the normal takeover and 3 means a "
                         "message needed a second AckWait.")
    section.notes.append("JetStream's kill recovery is bounded by AckWait by design (the server cannot "
                         "tell a dead worker from a slow one); pick queue.ack_wait_s accordingly (default 60 s).")


def run(env: Env, quick: bool, ctx: dict[str, Section] | None = None) -> Section:
    return run_section(KEY, "Recovery: SIGKILL takeover and SIGTERM drain", COMMAND + (" --quick" if quick else ""),
                       lambda s: measure(env, quick, s))


def main(argv: list[str] | None = None) -> int:
    return bench_main(KEY, run, needs=("rabbit", "site"), argv=argv)


if __name__ == "__main__":
    sys.exit(main())
