"""The whole daemon on JetStream: server restarts, retry via nak(delay), dead stream, replay."""
from __future__ import annotations

import json
import time
import uuid

import nats as natspy
import pytest
from crawld_proc import Crawld, run_always_500_against_300_good
from harness import run_async, wait_until

from crawld.transports.jetstream import DEAD_STREAM


def _key() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def make_crawld(make_crawld, js_server):
    def build(env: dict | None = None, **sections) -> Crawld:
        sections["broker"] = {"reconnect_max_s": 1, **sections.get("broker", {})}
        return make_crawld("jetstream", env=env, broker_url=js_server.url, **sections)
    return build


async def _dead_messages(url: str) -> list:
    nc = await natspy.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(DEAD_STREAM)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            out.append(await js.get_msg(DEAD_STREAM, seq))
        return out
    finally:
        await nc.close()


@pytest.mark.parametrize("tasks", [300, 1000])
def test_nats_server_killed_and_restarted_midrun_loses_nothing(make_crawld, site, js_server, tasks):
    daemon = make_crawld(workers={"count": 2, "threads": 8}, queue={"prefetch": 8, "ack_wait_s": 5})
    key = _key()
    assert daemon.publish([site.url(f"/slow/0.05/{key}-{i}") for i in range(tasks)]).returncode == 0
    daemon.start()
    wait_until(lambda: daemon.finished() >= tasks // 5, 60, what="a fifth done")
    workers = set(daemon.worker_pids())
    js_server.kill()
    stored_at_kill = daemon.count("results")
    # The kill really lands mid-run: the rest has to come through the restarted server.
    assert tasks // 5 <= stored_at_kill < tasks
    time.sleep(1.0)
    js_server.restart()
    daemon.wait_finished(tasks, timeout=180)
    assert daemon.stop() == 0
    rc, rec = daemon.reconcile()
    assert rc == 0 and rec["lost"] == [] and daemon.count("results") == tasks
    assert daemon.count("dead") == 0
    reconnected = {e["pid"] for e in daemon.events("broker_reconnected")}
    assert workers and workers <= reconnected, "every worker came back over a reconnect"


def test_always_500_naks_with_delay_then_dead_stream(make_crawld, site, js_server):
    daemon = make_crawld(workers={"count": 1, "threads": 4},
                         queue={"prefetch": 4, "retry_delays_s": [1, 2, 3], "max_deliver": 4})
    run_always_500_against_300_good(daemon, site, _key())
    msgs = run_async(_dead_messages(js_server.url))
    assert len(msgs) == 1
    assert msgs[0].headers["x-crawld-attempt"] == "4"
    assert "HTTP 500" in msgs[0].headers["x-crawld-error"]
    assert msgs[0].subject.startswith("crawl.dead.")
    status = json.loads(daemon.cli("status", "--json").stdout)
    assert status["broker"]["num_pending"] == 0 and status["broker"]["dead_messages"] == 1


def test_dlq_replay_after_fix_jetstream(make_crawld, site):
    daemon = make_crawld(workers={"count": 1, "threads": 4},
                         queue={"retry_delays_s": [0.5], "max_deliver": 2})
    key = _key()
    assert daemon.publish([site.url(f"/flaky/2/{key}-{i}") for i in range(5)]).returncode == 0
    daemon.start()
    wait_until(lambda: daemon.count("dead") == 5, 60, what="5 dead")
    replay = daemon.cli("dlq", "replay", "--all")
    assert replay.returncode == 0 and "replayed 5" in replay.stdout
    wait_until(lambda: daemon.count("results") == 5, 30, what="replayed tasks done")
    assert daemon.stop() == 0
    assert daemon.count("dead") == 0
    assert daemon.reconcile()[0] == 0


async def _publish_raw(url: str, subject: str, bodies: list[bytes]) -> None:
    nc = await natspy.connect(url)
    try:
        js = nc.jetstream()
        for body in bodies:
            await js.publish(subject, body)
    finally:
        await nc.close()


def test_malformed_messages_dead_and_terminated(make_crawld, site, js_server):
    daemon = make_crawld(workers={"count": 1})
    daemon.start()
    daemon.wait_workers(1)
    good = site.url(f"/fast/{_key()}")
    bodies = [b"not json", b"\xff\xfe", b'{"url": 3}', json.dumps({"url": good}).encode()]
    run_async(_publish_raw(js_server.url, "crawl.url.plainclient", bodies))
    wait_until(lambda: daemon.count("dead") == 3 and daemon.count("results") == 1, 30,
               what="3 dead + 1 result")
    assert daemon.stop() == 0
    assert len(run_async(_dead_messages(js_server.url))) == 3
    status = json.loads(daemon.cli("status", "--json").stdout)
    assert status["broker"]["num_pending"] == 0 and status["broker"]["num_ack_pending"] == 0
