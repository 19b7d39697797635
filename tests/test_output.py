"""Archive-grade output end to end: WARC files written by real `crawld run` workers, read
back at the offsets in the results table by warcio and by fastwarc, recovered after a
SIGKILL, rolled at a size; result events received by plain pika / nats-py consumers
across a broker restart; the new columns migrated on SQLite and PostgreSQL."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import fastwarc.warc as fastwarc
import pika
import pytest
from harness import NatsServer, older_database, wait_until
from test_warc import fastwarc_slice, warcio_check
from warcio.archiveiterator import ArchiveIterator

from crawld.config import StoreConfig
from crawld.output.warc import REFERS_TO_LOCATION, WarcLocation, parse_location, read_record
from crawld.store import SCHEMA, ResultRow, open_store

ROW_COLUMNS = "task_id, url, final_url, status, bytes, redirects, warc_file, warc_offset, warc_length"
CAP = 100_000


def _key() -> str:
    return uuid.uuid4().hex[:8]


def _rows(daemon: Any) -> list[dict[str, Any]]:
    names = [c.strip() for c in ROW_COLUMNS.split(",")]
    return [dict(zip(names, r)) for r in daemon.store.query(f"SELECT {ROW_COLUMNS} FROM results")]


def _closed_files(warc_dir: Path) -> list[str]:
    assert not list(warc_dir.glob("*.open")), "every worker closed (or recovered) its file"
    return sorted(str(p) for p in warc_dir.glob("*.warc.gz"))


def _sha1_b32(data: bytes) -> str:
    return "sha1:" + base64.b32encode(hashlib.sha1(data).digest()).decode()


def _check_row(row: dict[str, Any], warc_dir: Path) -> bytes:
    """The row's record read by warcio and fastwarc from its byte range; the payload
    (followed to its original for a revisit) with its digest verified. Returns it."""
    loc = WarcLocation(row["warc_file"], row["warc_offset"], row["warc_length"])
    rec = read_record(loc.file, loc.offset, loc.length, directory=str(warc_dir))
    assert rec.rec_headers.get_header("WARC-Target-URI") == row["final_url"]
    assert rec.rec_type in ("response", "revisit")
    fw_type, _headers, _status, fw_body = fastwarc_slice(warc_dir, loc)
    digest = rec.rec_headers.get_header("WARC-Payload-Digest")
    if rec.rec_type == "revisit":
        assert fw_type == fastwarc.WarcRecordType.revisit
        original = parse_location(rec.rec_headers.get_header(REFERS_TO_LOCATION))
        orig = read_record(original.file, original.offset, original.length, directory=str(warc_dir))
        assert orig.rec_type == "response"
        assert orig.rec_headers.get_header("WARC-Record-ID") == rec.rec_headers.get_header("WARC-Refers-To")
        fastwarc_slice(warc_dir, original)
        rec = orig
    payload = rec.content_stream().read()
    assert _sha1_b32(payload) == digest
    if fw_type == fastwarc.WarcRecordType.response:
        assert fw_body == payload
    return payload


def _records_in(paths: list[str]) -> Counter:
    counts: Counter = Counter()
    for path in paths:
        with open(path, "rb") as f:
            counts.update(r.rec_type for r in ArchiveIterator(f))
    return counts


def test_thousand_tasks_every_row_readable_at_its_offset(make_crawld, sites, tmp_store):
    """Ten sites, so both workers own shards and write WARC files."""
    daemon = make_crawld("amqp", workers={"count": 2, "threads": 8}, queue={"prefetch": 8},
                         fetch={"max_body_bytes": CAP}, output={"events": False})
    key = _key()

    def spread(path: str, n: int) -> list[str]:
        return [sites[i % len(sites)].url(path.format(i=i)) for i in range(n)]
    urls = (spread(f"/fast/{key}-{{i}}", 700) + spread(f"/redirect/2/{key}-r{{i}}", 150)
            + spread(f"/404/{key}-{{i}}", 100)
            + spread(f"/big/5000/{key}-{{i}}", 30)               # one payload: revisits
            + spread(f"/chunked/{3 * CAP}/{key}-{{i}}", 20))     # cut at the cap
    assert daemon.publish(urls).returncode == 0
    daemon.start()
    daemon.wait_finished(1000, timeout=180)
    assert daemon.stop() == 0

    rows = _rows(daemon)
    assert len(rows) == 1000
    statuses = Counter(r["status"] for r in rows)
    assert statuses == {"fetched": 730, "redirected": 150, "http_error": 100, "skipped": 20}
    assert all(r["warc_file"] and r["warc_length"] for r in rows), "every fetch is archived"
    warc_dir = tmp_store.warc_dir
    kinds: Counter = Counter()
    for row in rows:
        payload = _check_row(row, warc_dir)
        rec = read_record(row["warc_file"], row["warc_offset"], row["warc_length"], directory=str(warc_dir))
        kinds[rec.rec_type] += 1
        if row["status"] == "skipped":            # too_large: the first CAP bytes, marked
            assert rec.rec_headers.get_header("WARC-Truncated") == "length"
            assert len(payload) == CAP
        else:
            assert len(payload) == row["bytes"]
    # 30 identical payloads: one response per worker (the dedup map is the writer's), the
    # rest revisits
    writers_of_big = {r["warc_file"] for r in rows if "/big/" in r["url"]}
    assert kinds["revisit"] == 30 - len(writers_of_big) > 0

    paths = _closed_files(warc_dir)
    assert len(paths) == 2, "one file per worker at the default warc_max_bytes"
    warcio_check(paths)
    counts = _records_in(paths)
    fetches = sum(r["redirects"] + 1 for r in rows)            # every hop is an exchange
    assert counts["response"] + counts["revisit"] == fetches == 1000 + 2 * 150
    assert counts["request"] == fetches and counts["warcinfo"] == len(paths)

    redirected = next(r for r in rows if r["status"] == "redirected")
    shown = daemon.cli("show", redirected["task_id"], "--json", "--body")
    assert shown.returncode == 0, shown.stderr
    page = json.loads(shown.stdout)
    assert page["row"]["final_url"] == redirected["final_url"] and "<h1>200</h1>" in page["body"]
    assert page["status_line"].startswith("HTTP/1.1 200")
    assert daemon.cli("show", "no-such-task").returncode == 1


def test_sigkilled_worker_file_recovered_and_acked_records_readable(make_crawld, site, tmp_store):
    daemon = make_crawld("amqp", workers={"count": 1, "threads": 8}, queue={"prefetch": 8},
                         output={"events": False})
    key = _key()
    urls = [site.url(f"/chunked/200000/{key}-{i}") for i in range(300)]
    assert daemon.publish(urls).returncode == 0
    daemon.start()
    [victim] = daemon.wait_workers(1)
    wait_until(lambda: daemon.count("results") >= 60, 60, what="a part of the tasks stored")
    os.kill(victim, signal.SIGKILL)                  # mid-stream: writes are continuous
    daemon.wait_finished(300, timeout=120)
    assert daemon.stop() == 0

    recovered = daemon.events("warc_file_recovered")
    assert any(f"-{victim}.warc.gz" in e["file"] for e in recovered), recovered
    rows = _rows(daemon)
    assert len(rows) == 300 and daemon.count("results", "status = 'fetched'") == 300
    assert any(f"-{victim}.warc.gz" in r["warc_file"] for r in rows)
    for row in rows:                               # every acked task was stored before its ack
        assert len(_check_row(row, tmp_store.warc_dir)) == 200_000
    warcio_check(_closed_files(tmp_store.warc_dir))


def test_small_warc_max_bytes_rolls_into_several_valid_files(make_crawld, site, tmp_store):
    daemon = make_crawld("amqp", workers={"count": 2, "threads": 4}, queue={"prefetch": 4},
                         store={"warc_max_bytes": 1 << 20}, output={"events": False})
    key = _key()
    urls = [site.url(f"/chunked/60000/{key}-{i}") for i in range(120)]   # ~7 MB, incompressible
    assert daemon.publish(urls).returncode == 0
    daemon.start()
    daemon.wait_finished(120, timeout=120)
    assert daemon.stop() == 0
    paths = _closed_files(tmp_store.warc_dir)
    assert len(paths) >= 6, paths
    for path in paths:
        assert os.path.getsize(path) <= (1 << 20) + 70_000, "rolled before passing the limit"
        with open(path, "rb") as f:
            assert next(iter(ArchiveIterator(f))).rec_type == "warcinfo"
    warcio_check(paths)
    rows = _rows(daemon)
    assert len({r["warc_file"] for r in rows}) == len(paths)
    for row in rows:
        _check_row(row, tmp_store.warc_dir)


# -- result events -------------------------------------------------------------------------
def _event_ids(bodies: list[bytes], expect: dict[str, str]) -> set[str]:
    """Task ids of the events (deduplicated), each checked against the stored row."""
    seen = set()
    for body in bodies:
        event = json.loads(body)
        assert event["status"] == expect[event["task_id"]]
        assert event["warc_file"] and event["warc_offset"] is not None and event["warc_length"]
        assert event["url"] and event["final_url"] and event["fetched_at"] and event["http_status"]
        seen.add(event["task_id"])
    return seen


def _stored_statuses(daemon: Any) -> dict[str, str]:
    return dict(daemon.store.query("SELECT task_id, status FROM results"))


def _run_across_restart(daemon: Any, site: Any, restart: Any, n: int = 400) -> dict[str, str]:
    key = _key()
    urls = ([site.url(f"/slow/0.05/{key}-{i}") for i in range(n - 50)]
            + [site.url(f"/404/{key}-{i}") for i in range(50)])
    assert daemon.publish(urls).returncode == 0
    daemon.start()
    wait_until(lambda: daemon.count("results") >= n // 4, 60, what="a quarter stored")
    restart()
    daemon.wait_finished(n, timeout=180)
    assert daemon.stop() == 0
    return _stored_statuses(daemon)


def test_pika_consumer_gets_an_event_for_every_stored_task_across_restart(make_crawld, site, rabbit):
    events_queue = f"events-{_key()}"
    with rabbit.channel() as ch:      # a plain consumer's setup, as a downstream stage has it
        ch.exchange_declare("crawl.events", exchange_type="topic", durable=True)
        ch.queue_declare(events_queue, durable=True)
        ch.queue_bind(events_queue, "crawl.events", routing_key="#")
    daemon = make_crawld("amqp", workers={"count": 2, "threads": 8}, queue={"prefetch": 8})
    stored = _run_across_restart(daemon, site, rabbit.restart)
    assert len(stored) == 400
    bodies, keys = [], Counter()
    conn = pika.BlockingConnection(pika.URLParameters(rabbit.url))
    try:
        ch = conn.channel()
        for method, props, body in ch.consume(events_queue, inactivity_timeout=3):
            if method is None:
                break
            assert props.message_id == json.loads(body)["task_id"]
            assert (props.content_type, props.type, props.app_id, props.delivery_mode) == (
                "application/json", "crawl.result", "crawld", 2)
            keys[method.routing_key] += 1
            bodies.append(body)
            ch.basic_ack(method.delivery_tag)
        ch.cancel()
    finally:
        conn.close()
    assert _event_ids(bodies, stored) == set(stored)
    assert set(keys) == {"fetched", "http_error"}
    rabbit.delete_queues(events_queue)
    print(f"\nAMQP events across a restart: {len(bodies)} for {len(stored)} tasks "
          f"({len(bodies) - len(stored)} resent)")


def test_nats_consumer_gets_an_event_for_every_stored_task_across_restart(make_crawld, site, tmp_path):
    server = NatsServer()
    server.start()
    try:
        daemon = make_crawld("jetstream", broker_url=server.url, workers={"count": 2, "threads": 8},
                             queue={"prefetch": 8, "ack_wait_s": 10})
        stored = _run_across_restart(daemon, site, server.restart)
        assert len(stored) == 400
        bodies = asyncio.run(_read_events(server.url))
    finally:
        server.close()
    assert _event_ids(bodies, stored) == set(stored)
    print(f"\nJetStream events across a restart: {len(bodies)} for {len(stored)} tasks")


async def _read_events(url: str) -> list[bytes]:
    """A plain nats-py pull consumer on CRAWL_EVENTS, from the first event."""
    import nats
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe("crawl.event.>", durable="downstream", stream="CRAWL_EVENTS")
        bodies = []
        while True:
            try:
                msgs = await sub.fetch(200, timeout=2)
            except asyncio.TimeoutError:
                return bodies
            for msg in msgs:
                assert msg.headers["Nats-Msg-Id"] == json.loads(msg.data)["task_id"]
                assert msg.subject == "crawl.event." + json.loads(msg.data)["status"]
                bodies.append(msg.data)
                await msg.ack()
    finally:
        await nc.close()


# -- store: the index columns on both back ends, and the migration of older tables ---------
def _old_results_ddl() -> str:
    """The results table as crawld created it before the WARC columns (everything up to
    ``writes``, the last column of that release)."""
    current = next(stmt for stmt in SCHEMA if "TABLE IF NOT EXISTS results " in stmt)
    old = current.split("writes INTEGER NOT NULL DEFAULT 1")[0] + "writes INTEGER NOT NULL DEFAULT 1)"
    assert "warc" not in old
    return old


OLD_RESULTS = _old_results_ddl()


@pytest.fixture(params=["sqlite", "postgresql"])
def old_store_url(request, tmp_path) -> str:
    """A database whose results table an older crawld created, holding one row."""
    return older_database(request, tmp_path, OLD_RESULTS,
                          "INSERT INTO results (task_id, url, status, fetched_at) "
                          "VALUES ('old', 'http://h/old', 'fetched', 1.0)")


def test_older_results_table_gains_the_warc_columns(old_store_url, tmp_path):
    store = open_store(StoreConfig(url=old_store_url, body_dir=str(tmp_path / "bodies")))
    try:
        old = store.get_result("old")
        assert old["warc_file"] == "" and old["warc_offset"] is None
        offset = 5 * (1 << 30)          # past 2**31: BIGINT on PostgreSQL
        store.put_result(ResultRow(task_id="new", url="http://h/new", final_url="http://h/new",
                                   status="fetched", http_status=200, reason="", content_type="text/html",
                                   bytes=3, body_sha256="", attempts=1, fetched_at=time.time(),
                                   worker="w", warc_file="crawld-x.warc.gz", warc_offset=offset,
                                   warc_length=1234))
        row = store.get_result("new")
        assert (row["warc_file"], row["warc_offset"], row["warc_length"]) == ("crawld-x.warc.gz", offset, 1234)
    finally:
        store.close()
    again = open_store(StoreConfig(url=old_store_url, body_dir=str(tmp_path / "bodies")))
    again.close()                       # migrating twice is a no-op


@pytest.mark.parametrize("text, key", [
    ("[store]\nbodies = 'tar'\n", "store.bodies"),
    ("[store]\nwarc_max_bytes = 1000\n", "store.warc_max_bytes"),
    ("[output]\nevents = 'yes'\n", "output.events"),
])
def test_bad_output_config_exits_2_naming_the_key(tmp_path, text, key):
    path = tmp_path / "c.toml"
    path.write_text(text)
    done = subprocess.run([sys.executable, "-m", "crawld", "check-config", "-c", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and key in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("bodies", ["files", "none", "warc"])
def test_each_body_store_and_crawld_show_reads_it_back(tmp_path, site, bodies):
    """The handler's store step through make_body_sink for each store.bodies value, and
    ops/show reading the page back the way `crawld show` does."""
    from crawld.config import Config, FetchConfig, WorkersConfig, warc_directory
    from crawld.fetch import Fetcher
    from crawld.ops.show import load_page
    from crawld.output.sinks import make_body_sink
    from crawld.pipeline.handler import DeliveryHandler
    from crawld.task import new_task
    from crawld.transports.base import Action, Delivery

    cfg = Config(workers=WorkersConfig(run_dir=str(tmp_path / "run")),
                 fetch=FetchConfig(timeout_s=10, allow_networks=("127.0.0.0/8",)),
                 store=StoreConfig(url=f"sqlite:///{tmp_path / 'crawld.db'}",
                                   body_dir=str(tmp_path / "bodies"), bodies=bodies))
    store = open_store(cfg.store)
    fetcher = Fetcher(cfg.fetch, pool_size=2, run_dir=str(tmp_path))
    sink = make_body_sink(cfg, store)
    try:
        handler = DeliveryHandler(cfg, store, fetcher, worker_id="t:1", counts_deliveries=True,
                                  sink=sink)
        task = new_task(site.url(f"/redirect/1/{_key()}"))
        settled = handler.handle(Delivery(body=task.to_body(), message_id=task.task_id, attempt=1,
                                          redelivered=False, origin="crawl", handle=None))
        assert settled.action is Action.ACK
        page = load_page(cfg, store, task.task_id)
    finally:
        sink.close()
        fetcher.close()
        store.close()
    assert page.row["status"] == "redirected" and page.row["body_sha256"]
    warc_files = list(Path(warc_directory(cfg.store)).glob("*.warc.gz"))
    if bodies == "none":
        assert page.body is None and not (tmp_path / "bodies").exists() and not warc_files
        return
    assert b"<h1>200</h1>" in page.body
    assert hashlib.sha256(page.body).hexdigest() == page.row["body_sha256"]
    if bodies == "files":
        assert page.row["warc_file"] == "" and not warc_files
    else:
        assert page.row["warc_file"] == warc_files[0].name and page.status_line.startswith("HTTP/1.1 200")
        assert _records_in([str(warc_files[0])])["response"] == 2    # the redirect hop and the page
