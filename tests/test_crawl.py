"""Crawling on real brokers: hooks, link discovery within a scope, `crawld crawl`.

A generated 500-page site (``/site/<key>/500/p/<i>``, testsite.site_page): its home page
links, within depth 4, to exactly 500 pages, each child under several spellings, beside
off-site, nofollow, fragment-only and too-deep links. Two hosts crawl it from the home
page, one is SIGKILLed mid-crawl and restarted: each page is stored exactly once, the
outbox holds exactly the 500, no forbidden target is ever requested.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid

import pytest
from crawld_proc import TESTS_DIR
from harness import wait_until
from test_cluster import kill_host, make_host, pg_url  # noqa: F401  (fixtures)

from crawld.devtools.testsite import site_depth
from crawld.task import task_id_for

SITE_PAGES = 500
LINKS = ["crawld.hooks.links:extract"]


def _log(msg: str) -> None:
    print(f"\n[crawl] {msg}", flush=True)


def _hooks_env() -> dict[str, str]:
    path = [TESTS_DIR, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}


def _expected(site, key: str) -> dict[str, str]:
    urls = [site.url(f"/site/{key}/{SITE_PAGES}/p/{i}") for i in range(SITE_PAGES)]
    return {task_id_for(u): u for u in urls}


@pytest.mark.parametrize("transport", ["amqp", "jetstream"])
def test_crawl_500_pages_two_hosts_one_killed(request, make_host, site, tmp_path, transport):
    """amqp: one PostgreSQL store; jetstream: one SQLite file (both hosts on this machine)."""
    from harness import NatsServer
    if transport == "jetstream":
        nats = NatsServer()
        nats.start()
        broker_url, store_url = nats.url, f"sqlite:///{tmp_path / 'shared.db'}"
    else:
        nats = None
        broker_url, store_url = request.getfixturevalue("rabbit").url, request.getfixturevalue("pg_url")
    try:
        _crawl_with_a_kill(make_host, site, transport, broker_url, store_url)
    finally:
        if nats is not None:
            nats.close()


def _crawl_with_a_kill(make_host, site, transport: str, broker_url: str, store_url: str) -> None:
    common = dict(broker_url=broker_url, transport=transport, store_url=store_url,
                  workers={"count": 2, "threads": 8}, queue={"prefetch": 8, "ack_wait_s": 5},
                  pipeline={"hooks": LINKS}, scope={"max_depth": 2})   # the seed says 4
    host_a = make_host("host-a", **common)
    host_b = make_host("host-b", **common)
    key = uuid.uuid4().hex[:8]
    expected = _expected(site, key)
    home = site.url(f"/site/{key}/{SITE_PAGES}/p/0")

    t0 = time.monotonic()
    host_a.start()
    host_b.start()
    host_a.wait_workers(2)
    host_b.wait_workers(2)
    seeded = host_a.cli("crawl", "--max-depth", "4", home)
    assert seeded.returncode == 0, seeded.stdout + seeded.stderr
    assert "seeds 1  new 1" in seeded.stdout and "confirmed 1" in seeded.stdout
    wait_until(lambda: host_a.count("results") >= 120, 60, interval=0.05, what="120 pages stored")
    at_kill = host_a.count("results")
    killed = kill_host(host_a)
    assert at_kill < SITE_PAGES, "the kill must land mid-crawl"
    host_a.start()
    wait_until(lambda: host_b.count("results") >= SITE_PAGES and _settled(host_b), 120,
               interval=0.2, what=f"{SITE_PAGES} pages stored (have {host_b.count('results')})")
    elapsed = time.monotonic() - t0
    time.sleep(1.0)            # stray redeliveries: acked as duplicates, never stored again
    assert host_a.stop() == 0 and host_b.stop() == 0

    store = host_b.store
    rows = dict(store.query("SELECT task_id, url FROM results"))
    assert rows == expected, "each of the 500 pages stored, nothing else"
    assert store.query("SELECT COUNT(*), COUNT(DISTINCT task_id) FROM results")[0] == (SITE_PAGES, SITE_PAGES)
    outbox = store.query("SELECT task_id, url, depth, state FROM outbox")
    assert len(outbox) == SITE_PAGES and {r[0] for r in outbox} == set(expected)
    assert all(r[3] == "confirmed" for r in outbox)
    depths = {r[1]: r[2] for r in outbox}
    assert all(depths[u] == site_depth(int(u.rsplit("/", 1)[1])) for u in depths)
    assert max(depths.values()) == 4, "the seed's --max-depth 4 beat [scope] max_depth = 2"
    # hooks_done is a hint written without waiting for its commit: the killed host may
    # have lost a few for pages it had acked (their links were confirmed before the ack).
    hooks_done = store.query("SELECT COUNT(*) FROM hooks_done")[0][0]
    assert SITE_PAGES - 64 <= hooks_done <= SITE_PAGES
    assert host_b.count("dead") == 0
    for forbidden in ("offsite", "nofollow", "deep", "blocked"):
        assert site.total_hits(f"/site/{key}/{forbidden}/") == 0, forbidden
    assert all(site.hits(f"/site/{key}/{SITE_PAGES}/p/{i}") >= 1 for i in range(SITE_PAGES))
    refetched = site.total_hits(f"/site/{key}/{SITE_PAGES}/p/") - SITE_PAGES
    rc, rec = host_b.reconcile()
    assert rc == 0 and rec["lost"] == [], rec
    reruns = len(host_a.events("hooks_rerun")) + len(host_b.events("hooks_rerun"))
    refetches = len(host_a.events("hooks_refetch")) + len(host_b.events("hooks_refetch"))
    _log(f"{transport}: {SITE_PAGES} pages in {elapsed:.1f}s from one seed, host A killed "
         f"({len(killed)} processes) at {at_kill} stored; pages fetched again {refetched}, "
         f"hooks re-run on stored pages {reruns}, pages fetched again for their hooks {refetches}")


@pytest.mark.parametrize("transport", ["amqp", "jetstream"])
def test_crawl_500_pages_fetches_each_exactly_once(make_crawld, site, transport):
    """Without a kill nothing is fetched twice: every page exactly one request, one row,
    one outbox task, despite five spellings of each link and links back to known pages."""
    daemon = make_crawld(transport, workers={"count": 2, "threads": 8}, queue={"prefetch": 8},
                         pipeline={"hooks": LINKS}, scope={"max_depth": 4})
    key = uuid.uuid4().hex[:8]
    expected = _expected(site, key)
    daemon.start()
    seeded = daemon.cli("crawl", site.url(f"/site/{key}/{SITE_PAGES}/p/0"))
    assert seeded.returncode == 0, seeded.stderr
    wait_until(lambda: daemon.count("results") >= SITE_PAGES and _settled(daemon), 90,
               interval=0.2, what="500 pages stored")
    assert daemon.stop() == 0
    assert dict(daemon.store.query("SELECT task_id, url FROM results")) == expected
    assert daemon.count("results", "writes > 1") == 0
    assert {r[0] for r in daemon.store.query("SELECT task_id FROM outbox")} == set(expected)
    assert [site.hits(f"/site/{key}/{SITE_PAGES}/p/{i}") for i in range(SITE_PAGES)] == [1] * SITE_PAGES
    assert site.total_hits(f"/site/{key}/") == SITE_PAGES, "nothing off-site, nofollow or too deep"
    assert daemon.events("hooks_rerun") == [] and daemon.events("links_unconfirmed") == []


def _settled(daemon) -> bool:
    counts = daemon.store.counts()
    return counts["unconfirmed"] == 0 and daemon.store.pending_confirmed() == 0


@pytest.mark.parametrize("transport", ["amqp", "jetstream"])
def test_hook_that_raises_goes_dead_with_traceback(make_crawld, site, transport):
    daemon = make_crawld(transport, env=_hooks_env(),
                         workers={"count": 1, "threads": 4},
                         queue={"max_deliver": 3, "retry_delays_s": [0.5, 1.0]},
                         pipeline={"hooks": LINKS + ["crawl_hooks:explode_on_boom"]},
                         scope={"max_depth": 1})
    key = uuid.uuid4().hex[:8]
    good = [site.url(f"/fast/{key}-{i}") for i in range(20)]
    boom = site.url(f"/fast/{key}-boom")
    assert daemon.publish(good + [boom]).returncode == 0
    daemon.start()
    # 21 seeds, and the one /fast/next their pages all link to (depth 1)
    wait_until(lambda: daemon.count("dead") == 1 and daemon.count("hooks_done") == 21, 60,
               interval=0.2, what="boom dead, the others' hooks done")
    assert daemon.stop() == 0
    dead = daemon.store.list_dead()
    assert [(d.url, d.reason, d.attempts) for d in dead] == [(boom, "hook_error", 3)]
    assert "Traceback (most recent call last)" in dead[0].error
    assert "RuntimeError: hook exploded on" in dead[0].error and "explode_on_boom" in dead[0].error
    attempts = daemon.store.attempts_for(dead[0].task_id)
    assert [a["attempt"] for a in attempts] == [1, 2]
    assert all(a["error"].startswith("hook_error: RuntimeError") for a in attempts)
    assert site.hits(f"/fast/{key}-boom") == 1, "the hooks re-ran on the stored page, no refetch"
    assert daemon.count("results") == 22          # every page stored, boom's too
    assert daemon.count("hooks_done", f"task_id = '{dead[0].task_id}'") == 0
    assert {u for (u,) in daemon.store.query("SELECT url FROM outbox")} == set(good) | {boom, site.url("/fast/next")}
    events = daemon.events("hook_retry") + daemon.events("hook_dead")
    assert events and all(e["task_id"] == dead[0].task_id and e["url"] == boom and "attempt" in e
                          for e in events)


@pytest.mark.parametrize("spec, says", [
    ("no_such_module_xyz:extract", "cannot import"),
    ("crawl_hooks:NOT_CALLABLE", "is not callable"),
    ("crawld.hooks.links", "is not of the form"),
])
def test_bad_hook_exits_2_naming_the_key(make_crawld, spec, says):
    daemon = make_crawld("amqp", env=_hooks_env(), broker_url="amqp://guest:guest@127.0.0.1:1/%2F",
                         pipeline={"hooks": LINKS + [spec]})
    for args in (["check-config"], ["run"]):
        done = daemon.cli(*args, timeout=30)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (args, done.stderr)
        assert len(lines) == 1 and "pipeline.hooks" in lines[0] and says in lines[0], lines
        assert "Traceback" not in done.stderr
    done = daemon.cli("check-config", env={"CRAWLD_PIPELINE_HOOKS": json.dumps([spec])})
    assert done.returncode == 2 and "pipeline.hooks" in done.stderr


def test_crawl_command_checks_its_flags(make_crawld):
    daemon = make_crawld("amqp", broker_url="amqp://guest:guest@127.0.0.1:1/%2F")
    done = daemon.cli("crawl", "--deny", "([", "http://127.0.0.1/")
    assert done.returncode == 2 and "--deny" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    done = daemon.cli("crawl", "--max-depth", "-1", "http://127.0.0.1/")
    assert done.returncode == 2 and "--max-depth" in done.stderr


OLD_OUTBOX = ("CREATE TABLE outbox (task_id TEXT PRIMARY KEY, url TEXT NOT NULL, round TEXT NOT NULL, "
              "source TEXT NOT NULL, state TEXT NOT NULL DEFAULT 'new', tries INTEGER NOT NULL DEFAULT 0, "
              "created_at DOUBLE PRECISION NOT NULL, confirmed_at DOUBLE PRECISION, "
              "last_error TEXT NOT NULL DEFAULT '')")


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_outbox_from_an_older_crawld_is_migrated(request, tmp_path, backend):
    """An outbox an older crawld created gains depth, parent and extra (and the parent index,
    and the ordered state index in place of the plain one);
    its rows keep working as seeds, and discovered tasks round-trip through it."""
    import sqlite3

    from crawld.config import StoreConfig
    from crawld.store import open_store
    from crawld.task import new_task
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'old.db'}"
        with sqlite3.connect(tmp_path / "old.db") as conn:
            conn.execute(OLD_OUTBOX)
            conn.execute("CREATE INDEX outbox_state ON outbox (state)")
            conn.execute("INSERT INTO outbox (task_id, url, round, source, created_at) "
                         "VALUES ('old', 'http://h/old', '0', 'default', 1)")
    else:
        import psycopg
        url = request.getfixturevalue("postgres").create_database(f"m{uuid.uuid4().hex[:10]}")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(OLD_OUTBOX)
            conn.execute("INSERT INTO outbox (task_id, url, round, source, created_at) "
                         "VALUES ('old', 'http://h/old', '0', 'default', 1)")
    store = open_store(StoreConfig(url=url, body_dir=str(tmp_path / "bodies")))
    try:
        old = store.outbox_unconfirmed()
        assert [(t.task_id, t.depth, t.parent, t.scope) for t in old] == [("old", 0, "", "")]
        child = dataclasses.replace(new_task("http://h/child"), depth=2, parent="old",
                                    scope='{"max_depth":3}', meta='{"priority":1}')
        store.outbox_insert([child, child])
        assert [t.task_id for t in store.outbox_unconfirmed_children("old")] == [child.task_id]
        back = {t.task_id: t for t in store.outbox_unconfirmed()}[child.task_id]
        assert (back.depth, back.parent, back.scope, back.meta) == (2, "old", child.scope, child.meta)
        store.put_hooks_done("old", 3)
        assert store.hooks_done("old") and not store.hooks_done(child.task_id)
        if backend == "sqlite":     # the state index gave way to (state, created_at, task_id)
            indexes = {r[0] for r in store.query("SELECT name FROM sqlite_master WHERE type = 'index'")}
            assert "outbox_state_order" in indexes and "outbox_state" not in indexes, indexes
    finally:
        store.close()


def test_unconfirmed_links_are_published_by_the_redelivery(rabbit, site, tmp_path, queue_name):
    """The broker refuses the page's links: the page is given back (links_unconfirmed) with
    its links `new` in the outbox; its redelivery runs the hooks on the stored page and
    publishes them, without fetching the page again."""
    from harness import free_port

    from crawld.config import (BrokerConfig, Config, FetchConfig, PipelineConfig, QueueConfig,
                               ScopeConfig, StoreConfig, WorkersConfig)
    from crawld.fetch import Fetcher
    from crawld.pipeline.handler import DeliveryHandler
    from crawld.pipeline.hooks import PageHooks
    from crawld.stats import Stats
    from crawld.store import open_store
    from crawld.task import new_task
    from crawld.transports.base import Action, Delivery

    def config(broker_url: str) -> Config:
        return Config(broker=BrokerConfig(url=broker_url), queue=QueueConfig(name=queue_name),
                      workers=WorkersConfig(run_dir=str(tmp_path / "run")),
                      fetch=FetchConfig(allow_networks=("127.0.0.0/8",), per_host_concurrency=8),
                      store=StoreConfig(url=f"sqlite:///{tmp_path / 'c.db'}", body_dir=str(tmp_path / "b")),
                      pipeline=PipelineConfig(hooks=tuple(LINKS)), scope=ScopeConfig(max_depth=1))

    (tmp_path / "run").mkdir()
    from crawld.transports.amqp.topology import declare_topology
    with rabbit.channel() as ch:      # what the worker's transport declares (shards included)
        declare_topology(ch, config(rabbit.url))
    key = uuid.uuid4().hex[:8]
    seed = new_task(site.url(f"/site/{key}/{SITE_PAGES}/p/0"))
    children = {task_id_for(site.url(f"/site/{key}/{SITE_PAGES}/p/{i}")) for i in range(1, 6)}
    body = seed.to_body()
    store = open_store(config(rabbit.url).store)
    fetcher = Fetcher(config(rabbit.url).fetch, pool_size=2, run_dir=str(tmp_path / "run"), stats=Stats())
    try:
        for attempt, broker_url in ((1, f"amqp://guest:guest@127.0.0.1:{free_port()}/%2F"), (2, rabbit.url)):
            cfg = config(broker_url)
            hooks = PageHooks(cfg, store)
            handler = DeliveryHandler(cfg, store, fetcher, worker_id="t:1", counts_deliveries=True,
                                      hooks=hooks)
            settlement = handler.handle(Delivery(body=body, message_id=seed.task_id, attempt=attempt,
                                                 redelivered=attempt > 1, origin=queue_name, handle=None))
            hooks.close()
            outbox = dict(store.query("SELECT task_id, state FROM outbox"))
            if attempt == 1:
                assert (settlement.action, settlement.reason) == (Action.RELEASE, "links_unconfirmed")
                assert outbox == {c: "new" for c in children}, "written before the publish"
                assert not store.hooks_done(seed.task_id)
            else:
                assert (settlement.action, settlement.reason) == (Action.ACK, "duplicate")
                assert outbox == {c: "confirmed" for c in children}
        assert rabbit.work_depth(queue_name) == len(children)     # on their shards
        assert site.hits(f"/site/{key}/{SITE_PAGES}/p/0") == 1, "the redelivery did not fetch again"
        wait_until(lambda: store.hooks_done(seed.task_id), 5, what="hooks_done (posted, not awaited)")
    finally:
        fetcher.close()
        store.close()
        rabbit.delete_topology_of(config(rabbit.url))


def test_one_url_found_by_two_pages_at_once_is_published_by_one(tmp_path):
    """Two stores (two hosts' connections) insert the same discovered URL for two parents at
    once: one outbox row, and only the parent whose insert created it must publish it."""
    import threading

    from crawld.config import StoreConfig
    from crawld.pipeline.discover import to_publish
    from crawld.store import open_store
    from crawld.task import new_task
    stores = [open_store(StoreConfig(url=f"sqlite:///{tmp_path / 'c.db'}", body_dir=str(tmp_path / "b")))
              for _ in range(2)]
    try:
        for round_ in range(20):
            parents = [new_task(f"http://h.test/p{round_}-{i}") for i in range(2)]
            url = f"http://h.test/shared/{round_}"
            kids = [dataclasses.replace(new_task(url), depth=1, parent=p.task_id) for p in parents]
            out: list[list] = [[], []]
            barrier = threading.Barrier(2)

            def run(i: int) -> None:
                barrier.wait()
                out[i] = to_publish(stores[i], parents[i], [kids[i]])
            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            assert sorted(len(o) for o in out) == [0, 1], out
            assert stores[0].query("SELECT COUNT(*) FROM outbox WHERE url = ?", (url,))[0][0] == 1
    finally:
        for store in stores:
            store.close()
