"""Beyond one host, on real servers started by the tests.

* two "hosts" (two supervisors, separate configs and run dirs) on one RabbitMQ and one
  PostgreSQL, 5,000 tasks, one host SIGKILLed (supervisor and workers) mid-run and restarted;
* a three-node nats-server cluster with an R3 stream, one node SIGKILLed mid-run;
* a RabbitMQ quorum queue: crawld's own redelivery guard (x-delivery-count) and the
  broker's x-delivery-limit backstop dead-letter a poison task;
* PostgreSQL-only store behaviour (64-bit columns, migration, '%' in SQL, restarts).
"""
from __future__ import annotations

import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pika
import pytest
from crawld_proc import Crawld
from harness import NatsCluster, delete_crawld_topology, kill_pid, make_config, run_async, wait_until

from crawld.config import StoreConfig
from crawld.pipeline.crashguard import LONE_DEATHS
from crawld.store import PostgresStore, ResultRow, open_store
from crawld.task import new_task
from crawld.transports.amqp import dead_queue_name
from crawld.transports.jetstream import STREAM


def _key() -> str:
    return uuid.uuid4().hex[:8]


def _log(msg: str) -> None:
    print(f"\n[cluster] {msg}", flush=True)


# -- fixtures -----------------------------------------------------------------------------
@pytest.fixture
def pg_url(postgres) -> str:
    """A fresh database on the session's PostgreSQL: the one store every host shares."""
    return postgres.create_database(f"c{uuid.uuid4().hex[:10]}")


@pytest.fixture
def make_host(tmp_path: Path, queue_name: str) -> Iterator[Callable[..., Crawld]]:
    """One config file per "host": its own directory, run_dir (politeness locks, supervisor
    state) and body dir; the same queue name, broker and store for all of them."""
    made: list[Crawld] = []
    amqp: list[tuple[str, Path]] = []

    def build(name: str, *, broker_url: str, transport: str, store_url: str,
              env: dict[str, str] | None = None, **sections: dict[str, Any]) -> Crawld:
        home = tmp_path / name
        home.mkdir()
        sections.setdefault("log", {"format": "json"})
        sections["queue"] = {"name": queue_name, **sections.get("queue", {})}
        sections["store"] = {"url": store_url, "body_dir": str(home / "bodies")}
        sections["workers"] = {"run_dir": str(home / "run"), "drain_timeout_s": 20,
                               **sections.get("workers", {})}
        sections["fetch"] = {"per_host_concurrency": 64, "allow_networks": ["127.0.0.0/8"],
                             **sections.get("fetch", {})}
        sections["broker"] = {"reconnect_max_s": 2, **sections.get("broker", {})}
        daemon = Crawld(make_config(home, broker_url=broker_url, transport=transport, **sections),
                        env=env)
        made.append(daemon)
        if transport == "amqp":
            amqp.append((broker_url, daemon.config_path))
        return daemon

    yield build
    for daemon in made:
        daemon.close()
    for url, config_path in dict(amqp).items():     # one queue name for all hosts
        delete_crawld_topology(url, config_path)


def kill_host(daemon: Crawld) -> list[int]:
    """A host dies: freeze the supervisor and every descendant first (so nothing respawns
    and no worker notices its parent's death and drains), then SIGKILL them all."""
    assert daemon.proc is not None and daemon.proc.poll() is None
    pids = daemon.tree()
    for pid in pids:
        kill_pid(pid, signal.SIGSTOP)
    pids = list(dict.fromkeys(pids + daemon.tree()))
    for pid in pids:
        kill_pid(pid, signal.SIGKILL)
    daemon.proc.wait(10)
    wait_until(lambda: not any(_alive(p) for p in pids), 10, what="host processes gone")
    return pids


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def worker_pids_seen(daemon: Crawld) -> set[int]:
    return {int(e["worker_pid"]) for e in daemon.events("worker_spawned")}


# -- two hosts, one broker, one PostgreSQL ----------------------------------------------------
TWO_HOST_TASKS = 5000
# Published once the killed host is back: latency-bound work, so the restarted host finds
# some left whatever this machine's speed (host B's 32 threads alone need 1000 x 0.2 s / 32
# = 6 s for it, a rebalance a balance round or two). Fast pages alone were all done by B
# before A's new workers got a shard on a quick machine.
LATE_TASKS = 1000
LATE_PAGE_S = 0.2


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_two_hosts_one_postgres_host_killed_midrun(make_host, rabbit, sites, pg_url, queue_type):
    """Ten sites over four workers (partitioned or not)."""
    common = dict(broker_url=rabbit.url, transport="amqp", store_url=pg_url,
                  workers={"count": 2, "threads": 16}, queue={"prefetch": 16, "type": queue_type})
    host_a = make_host("host-a", **common)
    host_b = make_host("host-b", **common)
    key = _key()
    urls = [sites[i % len(sites)].url(f"/fast/{key}-{i}") for i in range(TWO_HOST_TASKS)]

    t0 = time.monotonic()
    published = host_a.publish(urls)
    assert published.returncode == 0, published.stdout + published.stderr
    t_pub = time.monotonic() - t0

    t1 = time.monotonic()
    host_a.start()
    host_b.start()
    wait_until(lambda: host_a.finished() >= TWO_HOST_TASKS // 4, 90, interval=0.05,
               what="a quarter done")
    done_at_kill = host_a.finished()
    killed = kill_host(host_a)
    assert TWO_HOST_TASKS // 4 <= done_at_kill < TWO_HOST_TASKS * 0.75, "the kill must land mid-run"
    assert host_a.finished() < TWO_HOST_TASKS, "work was left when host A died"
    t_kill = time.monotonic() - t1
    time.sleep(1.0)           # host B alone for a moment
    host_a.start()            # the host comes back: same config, same run_dir
    # B keeps running: with B SIGSTOPped here, A's `crawld run` hung at start (the store
    # opened before forking waits on B's open PostgreSQL transactions).
    host_a.wait_workers(2, timeout=60)
    late = [sites[i % len(sites)].url(f"/slow/{LATE_PAGE_S}/{key}-late-{i}") for i in range(LATE_TASKS)]
    assert host_a.publish(late).returncode == 0
    total = TWO_HOST_TASKS + LATE_TASKS
    host_b.wait_finished(total, timeout=150)
    t_run = time.monotonic() - t1
    time.sleep(1.0)           # let stray redeliveries be consumed (skipped as duplicates)
    assert host_a.stop() == 0
    assert host_b.stop() == 0

    rc, rec = host_b.reconcile()
    assert rc == 0 and rec["lost"] == [], rec
    assert host_a.count("results") == total
    assert host_a.store.query("SELECT COUNT(*), COUNT(DISTINCT task_id) FROM results")[0] == (total, total)
    assert host_a.count("dead") == 0
    assert rabbit.queue_depth(_queue(host_a)) == 0
    assert rabbit.work_depth(_queue(host_a)) == 0           # and the shards, when partitioned

    # Both hosts worked, and the restarted host A worked again after the kill.
    by_worker = dict(host_a.store.query("SELECT worker, COUNT(*) FROM results GROUP BY worker"))
    pids_a, pids_b = worker_pids_seen(host_a), worker_pids_seen(host_b)
    done_a = sum(n for w, n in by_worker.items() if int(w.rsplit(":", 1)[1]) in pids_a)
    done_b = sum(n for w, n in by_worker.items() if int(w.rsplit(":", 1)[1]) in pids_b)
    after_restart = sum(n for w, n in by_worker.items()
                        if int(w.rsplit(":", 1)[1]) in pids_a - set(killed))
    assert done_a + done_b == total
    assert done_a > 0 and done_b > 0
    assert after_restart > 0, "the restarted host A's new workers stored tasks"
    dup_writes = host_a.store.query("SELECT COUNT(*) FROM results WHERE writes > 1")[0][0]
    skipped = len(host_a.events("duplicate_skipped")) + len(host_b.events("duplicate_skipped"))
    _log(f"two hosts ({queue_type}): publish {TWO_HOST_TASKS} in {t_pub:.1f}s (and {LATE_TASKS} "
         f"slow ones after the restart); killed host A "
         f"({len(killed)} processes) at {done_at_kill} done, {t_kill:.1f}s in; all done "
         f"{t_run:.1f}s after start; host A {done_a} (after restart {after_restart}), host B "
         f"{done_b}; rows stored twice {dup_writes}, redeliveries skipped as done {skipped}")


def _queue(daemon: Crawld) -> str:
    from crawld.config import load_config
    return load_config(str(daemon.config_path)).queue.name


def test_unpartitioned_politeness_is_per_host_not_cluster_wide(make_host, rabbit, site, pg_url):
    """queue.partition = "none": fetch.per_host_concurrency is enforced through lock files in
    each host's run_dir: two hosts with a limit of 2 may hit one site with up to 4 requests
    at once, never more."""
    common = dict(broker_url=rabbit.url, transport="amqp", store_url=pg_url,
                  workers={"count": 2, "threads": 4}, queue={"prefetch": 4, "partition": "none"},
                  fetch={"per_host_concurrency": 2, "allow_networks": ["127.0.0.0/8"]})
    host_a = make_host("host-a", **common)
    host_b = make_host("host-b", **common)
    key = _key()
    assert host_a.publish([site.url(f"/slow/0.3/{key}-{i}") for i in range(40)]).returncode == 0
    host_a.start()
    host_b.start()
    host_a.wait_finished(40, timeout=60)
    assert host_a.stop() == 0 and host_b.stop() == 0
    peak = site.max_concurrent(f"/slow/0.3/{key}")
    assert 2 < peak <= 4, peak
    assert host_a.count("results") == 40
    _log(f"politeness: per_host_concurrency 2 on each of two hosts -> site peak {peak}")


# -- three-node NATS cluster, R3 stream -----------------------------------------------------
@pytest.fixture
def nats_cluster() -> Iterator[NatsCluster]:
    cluster = NatsCluster(3)
    try:
        cluster.start_all()
        yield cluster
    finally:
        cluster.close()


def _worker_connections(cluster: NatsCluster) -> list[int]:
    """crawld worker connections per node (from each running node's /connz page)."""
    import urllib.request

    out = []
    for node in cluster.nodes:
        count = 0
        if node.running:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{node.monitor_port}/connz?limit=1000",
                                            timeout=2) as resp:
                    conns = json.load(resp).get("connections") or []
                count = sum(1 for c in conns if str(c.get("name", "")).startswith("crawld-worker"))
            except (OSError, ValueError):
                pass
        out.append(count)
    return out


def _stream_info(cluster: NatsCluster) -> Any:
    async def info() -> Any:
        import nats

        nc = await nats.connect([n.url for n in cluster.nodes if n.running], connect_timeout=2)
        try:
            return await nc.jetstream(timeout=5).stream_info(STREAM)
        finally:
            await nc.close()
    return run_async(info())


def _retrying(what: Callable[[], Any], attempts: int = 20, delay: float = 0.5) -> Any:
    """Broker API calls right after a node died can time out or find no leader yet."""
    for i in range(attempts):
        try:
            return what()
        except Exception:   # nats errors, timeouts, "no responders" during an election
            if i == attempts - 1:
                raise
            time.sleep(delay)


def _roles(cluster: NatsCluster, consumer: str) -> dict[str, int | None]:
    return {"meta": _retrying(cluster.meta_leader),
            "stream": _retrying(lambda: cluster.stream_leader(STREAM)),
            "consumer": _retrying(lambda: cluster.stream_leader(STREAM, consumer))}


def _pick_victim(roles: dict[str, int | None], conns: list[int], which: str) -> int:
    if which == "stream_leader":
        assert roles["stream"] is not None
        return roles["stream"]
    # A node that leads neither the stream nor the consumer (meta too if possible),
    # preferably one that crawld workers are connected to.
    candidates = [i for i in range(3) if i not in (roles["stream"], roles["consumer"])] or \
                 [i for i in range(3) if i != roles["stream"]]
    return sorted(candidates, key=lambda i: (i == roles["meta"], -conns[i]))[0]


NATS_TASKS = 1000


@pytest.mark.parametrize("which", ["non_leader", "stream_leader"])
def test_nats_cluster_r3_node_killed_midrun(make_host, nats_cluster, site, pg_url, which):
    host = make_host("host-a", broker_url=nats_cluster.urls, transport="jetstream", store_url=pg_url,
                     workers={"count": 2, "threads": 16},
                     queue={"prefetch": 16, "replicas": 3, "ack_wait_s": 10})
    key = _key()
    published = host.publish([site.url(f"/slow/0.2/{key}-{i}") for i in range(NATS_TASKS)])
    assert published.returncode == 0, published.stdout + published.stderr
    info = _stream_info(nats_cluster)
    assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2
    assert info.state.messages == NATS_TASKS

    t0 = time.monotonic()
    host.start()
    wait_until(lambda: host.finished() >= NATS_TASKS // 4, 90, interval=0.05, what="a quarter done")
    queue = _queue(host)
    roles = _roles(nats_cluster, queue)
    conns = _worker_connections(nats_cluster)
    victim = _pick_victim(roles, conns, which)
    done_at_kill = host.finished()
    nats_cluster.kill(victim)
    t_kill = time.monotonic()
    # Mid-run: some tasks were stored before the kill, and (the count only grows) not all
    # of them by the time the node was dead.
    done_after_kill = host.finished()
    assert NATS_TASKS // 4 <= done_at_kill <= done_after_kill < NATS_TASKS, \
        (done_at_kill, done_after_kill)

    # Progress after the kill: the longest pause in completions shows the failover cost.
    last, last_change, longest_stall = done_at_kill, t_kill, 0.0
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        now_done = host.finished()
        now = time.monotonic()
        if now_done != last:
            longest_stall = max(longest_stall, now - last_change)
            last, last_change = now_done, now
        if now_done >= NATS_TASKS:
            break
        time.sleep(0.1)
    t_done = time.monotonic()
    assert host.finished() >= NATS_TASKS, f"only {host.finished()} of {NATS_TASKS} finished"
    roles_after = _roles(nats_cluster, queue)
    # A stored task whose ack died with the leader is still in the WorkQueue stream: it
    # comes back after AckWait, is recognised by task id and acked without a fetch.
    t_stored = time.monotonic()
    wait_until(lambda: _retrying(lambda: _stream_info(nats_cluster)).state.messages == 0,
               60, interval=0.5, what="every message acked (stream empty)")
    t_empty = time.monotonic() - t_stored
    # `crawld status` with the comma-separated URL list, one node down.
    status = host.cli("status", "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)["broker"].get("depth") == 0
    assert host.stop() == 0

    rc, rec = host.reconcile()
    assert rc == 0 and rec["lost"] == [], rec
    assert host.count("results") == NATS_TASKS and host.count("dead") == 0
    assert host.store.query("SELECT COUNT(DISTINCT task_id) FROM results")[0][0] == NATS_TASKS
    dup_writes = host.count("results", "writes > 1")
    skipped = len(host.events("duplicate_skipped"))
    reconnects = len(host.events("broker_reconnected"))
    pull_failures = len(host.events("jetstream_pull_failed"))
    acks_failed = len(host.events("settle_failed"))
    _log(f"nats R3 kill {which}: roles before {roles}, worker conns per node {conns}, killed "
         f"node {victim} at {done_at_kill}/{NATS_TASKS} done ({t_kill - t0:.1f}s in); roles "
         f"after {roles_after}; longest completion stall after kill {longest_stall:.1f}s; all "
         f"stored {t_done - t_kill:.1f}s after kill, stream empty {t_empty:.1f}s later; worker "
         f"reconnects {reconnects}, pull failures {pull_failures}, acks failed {acks_failed}, "
         f"rows stored twice {dup_writes}, duplicates skipped {skipped}")


# -- RabbitMQ quorum queue: delivery limit and dead-lettering --------------------------------
def _dead_queue_messages(rabbit, queue: str, limit: int = 100) -> list[tuple[dict, bytes]]:
    """Read (and requeue) what sits in ``<queue>.dead``: properties' headers and body."""
    out = []
    with rabbit.channel() as ch:
        tags = []
        for _ in range(limit):
            method, props, body = ch.basic_get(dead_queue_name(queue), auto_ack=False)
            if method is None:
                break
            out.append((dict(props.headers or {}), body))
            tags.append(method.delivery_tag)
        for tag in tags:
            ch.basic_nack(tag, requeue=True)
    return out


@pytest.mark.parametrize("held", [1, 4], ids=["prefetch1", "prefetch4"])
def test_quorum_poison_task_dead_lettered_by_worker_guard(make_host, rabbit, site, pg_url, held):
    """A task that kills every worker it reaches: quorum's x-delivery-count reaches
    queue.max_deliver and the next worker dead-letters it (store row + <queue>.dead)
    without touching it again.

    prefetch1: each worker holds one delivery, so a crash returns only the poison and
    every other task completes. prefetch4: a crash also returns the innocent deliveries
    the dying worker held, and they are counted too (x-delivery-count counts every
    return); returned messages go back to the head of the queue, so the same innocents
    tend to follow the poison into the next worker and reach the limit with it. At the
    limit each is only a suspect and runs alone in its worker: the innocents survive and
    are stored, the poison kills its worker in LONE_DEATHS runs alone and is dead as
    ``poison`` (issue 14)."""
    host = make_host("host-a", broker_url=rabbit.url, transport="amqp", store_url=pg_url,
                     env={"CRAWLD_TEST_FAULT": "poison"},
                     workers={"count": 2, "threads": held, "backoff_max_s": 1},
                     queue={"type": "quorum", "max_deliver": 2, "prefetch": held})
    key = _key()
    good = [site.url(f"/fast/{key}-{i}") for i in range(60)]
    poison = site.url(f"/poison/{key}")
    poison_id = new_task(poison).task_id
    assert host.publish(good[:30] + [poison] + good[30:]).returncode == 0
    queue = _queue(host)
    args = _queue_arguments(rabbit, queue)
    assert args.get("x-queue-type") == "quorum" and args.get("x-delivery-limit") == 4, args

    host.start()
    host.wait_finished(61, timeout=90)
    wait_until(lambda: rabbit.queue_depth(queue) == 0, 30, what="work queue empty")
    time.sleep(0.5)

    dead = {r.task_id: r for r in host.store.list_dead(limit=1000)}
    assert list(dead) == [poison_id] and dead[poison_id].reason == "poison", dead
    assert host.count("results") == 60, "no innocent neighbour dead-lettered with it"
    crashes = host.events("worker_died")
    # x-delivery-count absent, 1: crash beside others; 2, 3: the suspect's runs alone;
    # 4: dead, within the broker's x-delivery-limit (max_deliver + 2) that delivered it
    assert len(crashes) == 2 + LONE_DEATHS, crashes
    in_dead_queue = _dead_queue_messages(rabbit, queue)
    assert len(in_dead_queue) == len(dead)
    poison_copy = [h for h, b in in_dead_queue if json.loads(b)["url"] == poison]
    assert len(poison_copy) == 1
    rc, rec = host.reconcile()
    assert rc == 0 and rec["lost"] == []
    collateral = sorted(t for t in dead if t != poison_id)
    stored = {row[0] for row in host.store.query("SELECT task_id FROM results")}
    assert poison_id not in stored
    assert [r.task_id for r in host.store.list_dead(limit=1000)] == [poison_id]
    assert host.reconcile()[0] == 0
    assert host.stop() == 0
    _log(f"quorum poison (worker guard, prefetch {held}): {len(crashes)} worker crashes; poison "
         f"dead row {dead[poison_id].reason!r} ({dead[poison_id].error}); innocent tasks "
         f"dead-lettered with it: {len(collateral)}; dead-queue copy headers "
         f"{sorted(poison_copy[0])}")


def _queue_arguments(rabbit, queue: str) -> dict[str, Any]:
    out = rabbit.ctl("list_queues", "-q", "--formatter", "json", "name", "arguments")
    for row in json.loads(out.stdout):
        if row["name"] == queue:
            args = row["arguments"]       # 3.10: [[name, type, value], ...]
            return dict(args) if isinstance(args, dict) else {a[0]: a[-1] for a in args}
    raise AssertionError(f"queue {queue} not found")


def test_quorum_delivery_limit_backstop_when_worker_dies_before_parsing(make_host, rabbit, site, pg_url):
    """A consumer that dies before it can even look at the message (modelled by a plain
    pika consumer that takes it and drops its connection without an ack): crawld's own
    guard never runs, so the broker's x-delivery-limit (max_deliver + 2) dead-letters it to
    <queue>.dead. There is no store row for it: reconcile names it as lost."""
    host = make_host("host-a", broker_url=rabbit.url, transport="amqp", store_url=pg_url,
                     queue={"type": "quorum", "max_deliver": 2})
    url = site.url(f"/fast/{_key()}-pre-parse-crash")
    task_id = new_task(url).task_id
    assert host.publish([url]).returncode == 0
    queue = host.work_queue_of(url)          # its shard queue: quorum, with the same limit
    dead_queue = dead_queue_name(_queue(host))
    limit = _queue_arguments(rabbit, queue)["x-delivery-limit"]

    seen: list[Any] = []                   # x-delivery-count per delivery (None: absent)
    redelivered: list[bool] = []
    for _ in range(limit + 5):             # bounded: the broker must give up before this
        params = pika.URLParameters(rabbit.url)
        conn = pika.BlockingConnection(params)
        ch = conn.channel()
        ch.basic_qos(prefetch_count=1)
        taken: list[Any] = []              # no basic.get on a single-active-consumer queue
        ch.basic_consume(queue, lambda _ch, method, props, _body: taken.append((method, props)))
        got = None
        for _ in range(20):                # the return is asynchronous: wait up to ~2 s
            conn.process_data_events(time_limit=0.1)
            if taken:
                got = taken[0]
                break
            if rabbit.queue_depth(dead_queue) > 0:
                break
        if got is None:
            conn.close()
            break
        seen.append((got[1].headers or {}).get("x-delivery-count"))
        redelivered.append(bool(got[0].redelivered))
        conn.close()                       # "crash": no ack, the broker takes it back
    wait_until(lambda: rabbit.queue_depth(dead_queue) == 1, 10,
               what="message dead-lettered by the broker")
    assert rabbit.queue_depth(queue) == 0
    assert len(seen) == limit + 1, seen    # delivered limit+1 times, then dead-lettered
    headers, body = _dead_queue_messages(rabbit, _queue(host))[0]
    x_death = headers.get("x-death") or []
    assert json.loads(body)["task_id"] == task_id
    assert x_death and x_death[0].get("reason") == "delivery_limit", headers
    assert host.store.list_dead(task_ids=[task_id]) == []
    rc, rec = host.reconcile()
    assert rc == 1 and rec["lost"] == [task_id]
    _log(f"quorum backstop: x-delivery-limit={limit}; x-delivery-count per delivery {seen}; "
         f"redelivered flags {redelivered}; dead-queue x-death "
         f"{[{k: x.get(k) for k in ('reason', 'queue', 'count')} for x in x_death]}; "
         f"x-delivery-count in dead copy {headers.get('x-delivery-count')}; reconcile lost "
         f"{len(rec['lost'])}")


# -- PostgreSQL store: what differs from SQLite ---------------------------------------------
def _pg_store(url: str, tmp_path: Path) -> PostgresStore:
    store = open_store(StoreConfig(url=url, body_dir=str(tmp_path / "bodies")))
    assert isinstance(store, PostgresStore)
    return store


def _row(task_id: str, **kw: Any) -> ResultRow:
    base = dict(task_id=task_id, url=f"http://h/{task_id}", final_url="", status="fetched",
                http_status=200, reason="", content_type="text/html", bytes=3, body_sha256="",
                attempts=1, fetched_at=time.time(), worker="w")
    return ResultRow(**{**base, **kw})


def test_postgres_64bit_columns_and_migration(postgres, tmp_path):
    """SQLite's INTEGER is 64-bit; PostgreSQL's is not. A JetStream stream sequence past
    2**31-1 must still store, and an existing INTEGER column is migrated on start."""
    import psycopg

    url = postgres.create_database(f"m{uuid.uuid4().hex[:10]}")
    with psycopg.connect(url, autocommit=True) as conn:      # a table from an older crawld
        conn.execute("CREATE TABLE results (task_id TEXT PRIMARY KEY, url TEXT NOT NULL, "
                     "final_url TEXT NOT NULL DEFAULT '', status TEXT NOT NULL, http_status INTEGER, "
                     "reason TEXT NOT NULL DEFAULT '', content_type TEXT NOT NULL DEFAULT '', "
                     "bytes INTEGER NOT NULL DEFAULT 0, body_sha256 TEXT NOT NULL DEFAULT '', "
                     "attempts INTEGER NOT NULL DEFAULT 1, fetched_at DOUBLE PRECISION NOT NULL, "
                     "worker TEXT NOT NULL DEFAULT '', round TEXT NOT NULL DEFAULT '', "
                     "source TEXT NOT NULL DEFAULT '', redirects INTEGER NOT NULL DEFAULT 0, "
                     "enqueued_at DOUBLE PRECISION NOT NULL DEFAULT 0, stream_seq INTEGER, "
                     "writes INTEGER NOT NULL DEFAULT 1)")
        conn.execute("INSERT INTO results (task_id, url, status, fetched_at, stream_seq) "
                     "VALUES ('old', 'http://h/old', 'fetched', 1, 7)")
    store = _pg_store(url, tmp_path)
    try:
        types = dict(store.query("SELECT column_name, data_type FROM information_schema.columns "
                                 "WHERE table_name = 'results' AND column_name IN ('stream_seq', 'bytes')"))
        assert types == {"stream_seq": "bigint", "bytes": "bigint"}
        assert store.get_result("old")["stream_seq"] == 7
        store.put_result(_row("big", stream_seq=2**40, bytes=5 * 2**30))
        got = store.get_result("big")
        assert got["stream_seq"] == 2**40 and got["bytes"] == 5 * 2**30
    finally:
        store.close()


def test_postgres_literal_percent_and_question_mark_in_sql(postgres, tmp_path):
    store = _pg_store(postgres.create_database(f"q{uuid.uuid4().hex[:10]}"), tmp_path)
    try:
        store.put_result(_row("a", url="http://h/a?x=1"))
        store.put_result(_row("b", url="http://h/b"))
        assert store.query("SELECT COUNT(*) FROM results WHERE url LIKE '%?x=%'")[0][0] == 1
        assert store.query("SELECT task_id FROM results WHERE url LIKE '%h/%' AND task_id = ? "
                           "AND url <> 'it''s ?'", ("b",)) == [("b",)]
    finally:
        store.close()


def _open_and_write(url: str, body_dir: str, n: int) -> None:
    store = open_store(StoreConfig(url=url, body_dir=body_dir))
    store.put_result(_row(f"r{n}"))
    store.close()


def test_postgres_schema_creation_races_between_processes(postgres, tmp_path):
    """Several hosts starting at once against an empty database (advisory lock)."""
    import multiprocessing

    url = postgres.create_database(f"r{uuid.uuid4().hex[:10]}")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_open_and_write, args=(url, str(tmp_path / "b"), n)) for n in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 6
    store = _pg_store(url, tmp_path)
    try:
        assert store.query("SELECT COUNT(*) FROM results")[0][0] == 6
    finally:
        store.close()


def test_postgres_store_survives_server_restart(postgres, tmp_path):
    """Pooled connections are checked before use: after a restart no write fails."""
    store = _pg_store(postgres.create_database(f"s{uuid.uuid4().hex[:10]}"), tmp_path)
    try:
        import threading

        def burst(prefix: str) -> None:      # open several pooled connections
            threads = [threading.Thread(target=store.put_result, args=(_row(f"{prefix}{i}"),))
                       for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        burst("before")
        postgres.restart()
        for i in range(20):
            store.put_result(_row(f"after{i}"))
        burst("again")
        assert store.query("SELECT COUNT(*) FROM results")[0][0] == 32
    finally:
        store.close()


def test_postgres_bad_url_fails_fast_with_the_servers_reason(postgres, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="does not exist"):
        open_store(StoreConfig(url=postgres.url_for("no_such_db"), body_dir=str(tmp_path)))
    assert time.monotonic() - t0 < 5
