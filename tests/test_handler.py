"""The delivery path without a broker: DeliveryHandler with a real SQLite store and a
real local website, through every Action; RELEASE through a worker's drain; and the
``pipeline.middleware`` seam (loading, config errors, hook order)."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from crawld_proc import with_fault_middleware
from faults import FaultMiddleware
from structlog.testing import capture_logs

from crawld.config import Config, ConfigError, FetchConfig, QueueConfig, StoreConfig, WorkersConfig, load_config
from crawld.fetch import Fetcher
from crawld.pipeline.crashguard import LONE_DEATHS, Isolation
from crawld.pipeline.handler import DeliveryHandler
from crawld.pipeline.middleware import HOOKS, Middleware, MiddlewareChain, load_middleware
from crawld.pipeline.outcomes import Reason
from crawld.process.states import Phase
from crawld.process.worker import Worker
from crawld.stats import Stats
from crawld.store import Store, open_store
from crawld.task import new_task
from crawld.transports.base import Action, Delivery, Settlement, Transport

MAX_DELIVER = 3


def _key() -> str:
    return uuid.uuid4().hex[:8]


def delivery(body: bytes, attempt: int = 1, redelivered: bool = False,
             message_id: str | None = None, broker_redeliveries: int | None = None) -> Delivery:
    return Delivery(body=body, message_id=message_id, attempt=attempt, redelivered=redelivered,
                    origin="crawl", handle=None, broker_redeliveries=broker_redeliveries)


def task_delivery(url: str, **kwargs: Any) -> tuple[str, Delivery]:
    task = new_task(url)
    return task.task_id, delivery(task.to_body(), message_id=task.task_id, **kwargs)


class Recorder(Middleware):
    """Remembers which delivery hooks ran, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def before_fetch(self, delivery: Delivery, task: Any) -> None:
        self.calls.append("before_fetch")

    def before_store(self, delivery: Delivery, task: Any) -> None:
        self.calls.append("before_store")

    def after_store(self, delivery: Delivery, task: Any) -> None:
        self.calls.append("after_store")

    def before_settle(self, delivery: Delivery, settlement: Settlement) -> None:
        self.calls.append(f"before_settle:{settlement.action.value}")


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    return Config(
        queue=QueueConfig(max_deliver=MAX_DELIVER, retry_delays_s=(1.0, 2.0)),
        workers=WorkersConfig(threads=1, drain_timeout_s=10, run_dir=str(tmp_path / "run")),
        fetch=FetchConfig(timeout_s=10, per_host_concurrency=64, allow_networks=("127.0.0.0/8",)),
        store=StoreConfig(url=f"sqlite:///{tmp_path / 'crawld.db'}", body_dir=str(tmp_path / "bodies")))


@pytest.fixture
def store(cfg: Config) -> Iterator[Store]:
    opened = open_store(cfg.store)
    yield opened
    opened.close()


@pytest.fixture
def fetcher(cfg: Config) -> Iterator[Fetcher]:
    Path(cfg.workers.run_dir).mkdir(exist_ok=True)
    made = Fetcher(cfg.fetch, pool_size=4, run_dir=cfg.workers.run_dir, stats=Stats())
    yield made
    made.close()


@pytest.fixture
def make_handler(cfg: Config, store: Store, fetcher: Fetcher) -> Callable[..., DeliveryHandler]:
    def build(counts_deliveries: bool = False, middleware: Middleware | None = None) -> DeliveryHandler:
        return DeliveryHandler(cfg, store, fetcher, worker_id="test:1",
                               counts_deliveries=counts_deliveries, middleware=middleware)
    return build


# -- ACK --------------------------------------------------------------------------------
def test_fetched_page_is_stored_then_acked(make_handler, store, site):
    recorder = Recorder()
    url = site.url(f"/fast/{_key()}")
    task_id, d = task_delivery(url)
    settlement = make_handler(middleware=recorder).handle(d)
    assert (settlement.action, settlement.reason) == (Action.ACK, "fetched")
    assert settlement.task is not None and settlement.task.task_id == task_id
    row = store.get_result(task_id)
    assert row["status"] == "fetched" and row["http_status"] == 200 and row["attempts"] == 1
    assert row["worker"] == "test:1" and row["writes"] == 1 and row["body_sha256"]
    assert recorder.calls == ["before_fetch", "before_store", "after_store"]


def test_duplicate_is_acked_without_a_fetch(make_handler, store, site):
    handler = make_handler()
    path = f"/fast/{_key()}"
    task_id, first = task_delivery(site.url(path))
    assert handler.handle(first).action is Action.ACK
    _, again = task_delivery(site.url(path), redelivered=True)
    settlement = handler.handle(again)
    assert (settlement.action, settlement.reason) == (Action.ACK, Reason.DUPLICATE)
    assert settlement.reason == "duplicate"
    assert site.hits(path) == 1
    assert store.get_result(task_id)["writes"] == 1


@pytest.mark.parametrize("copies", [2, 3])
def test_concurrent_copies_of_one_task_fetch_once(make_handler, site, copies):
    """Later copies wait for the first (the claim) and then find the stored result."""
    handler = make_handler()
    path = f"/slow/1/{_key()}"
    deliveries = [task_delivery(site.url(path))[1] for _ in range(copies)]
    out: list[Settlement] = []
    threads = [threading.Thread(target=lambda d=d: out.append(handler.handle(d))) for d in deliveries]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(s.reason for s in out) == ["duplicate"] * (copies - 1) + ["fetched"]
    assert all(s.action is Action.ACK for s in out)
    assert site.hits(path) == 1
    assert handler._claims._active == {}, "every claim is released"


def test_http_404_is_a_valid_result(make_handler, store, site):
    task_id, d = task_delivery(site.url(f"/404/{_key()}"))
    settlement = make_handler().handle(d)
    assert (settlement.action, settlement.reason) == (Action.ACK, "http_error")
    assert store.get_result(task_id)["http_status"] == 404


# -- SKIP -------------------------------------------------------------------------------
def test_robots_disallowed_is_stored_skipped(make_handler, store, site):
    task_id, d = task_delivery(site.url(f"/private/{_key()}"))
    settlement = make_handler().handle(d)
    assert (settlement.action, settlement.reason) == (Action.SKIP, "skipped")
    row = store.get_result(task_id)
    assert row["status"] == "skipped" and row["reason"] == "robots"


# -- RETRY ------------------------------------------------------------------------------
def test_server_error_retries_with_the_tier_delay(make_handler, store, site):
    recorder = Recorder()
    task_id, d = task_delivery(site.url(f"/500/{_key()}"))
    settlement = make_handler(middleware=recorder).handle(d)
    assert (settlement.action, settlement.reason, settlement.delay_s) == (Action.RETRY, "http_500", 1.0)
    assert store.get_result(task_id) is None
    attempts = store.attempts_for(task_id)
    assert [(a["attempt"], a["delay_s"]) for a in attempts] == [(1, 1.0)]
    assert recorder.calls == ["before_fetch"], "nothing stored as a result"


def test_store_unavailable_is_deferred_without_an_attempt(make_handler, store, site, monkeypatch):
    class Bug(Middleware):
        def before_fetch(self, delivery: Delivery, task: Any) -> None:
            raise RuntimeError("bug in our code")

    def store_down(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(store, "put_dead", store_down)
    task_id, d = task_delivery(site.url(f"/fast/{_key()}"))
    handler = make_handler(middleware=Bug())
    settlement = handler.handle(d)
    assert (settlement.action, settlement.reason) == (Action.DEFER, "store")
    assert settlement.delay_s == 1.0 and "disk gone" in settlement.error
    assert store.get_result(task_id) is None, "nothing was stored, so nothing may be acked"
    assert store.attempts_for(task_id) == [], "no attempt used: not the task's fault"
    assert handler.pause.reason == "store", "the worker pauses on its own fault"


# -- DEAD -------------------------------------------------------------------------------
def test_last_attempt_failing_is_dead_retries_exhausted(make_handler, store, site):
    task_id, d = task_delivery(site.url(f"/500/{_key()}"), attempt=MAX_DELIVER)
    settlement = make_handler().handle(d)
    assert (settlement.action, settlement.reason) == (Action.DEAD, Reason.RETRIES_EXHAUSTED)
    [dead] = store.list_dead(task_ids=[task_id])
    assert (dead.reason, dead.attempts, dead.origin) == ("retries_exhausted", MAX_DELIVER, "crawl")


def test_delivered_past_max_deliver_is_dead_without_a_fetch(make_handler, store, site):
    path = f"/fast/{_key()}"
    task_id, d = task_delivery(site.url(path), attempt=MAX_DELIVER + 1)
    settlement = make_handler().handle(d)
    assert (settlement.action, settlement.reason) == (Action.DEAD, "retries_exhausted")
    assert site.hits(path) == 0
    assert store.list_dead(task_ids=[task_id])[0].reason == "retries_exhausted"


def test_broker_counted_redeliveries_make_a_suspect_that_runs_alone(make_handler, store, site):
    """At the limit a task is only a suspect: it runs alone, and surviving that, is stored."""
    path = f"/fast/{_key()}"
    task_id, d = task_delivery(site.url(path), redelivered=True, broker_redeliveries=MAX_DELIVER)
    handler = make_handler(counts_deliveries=True)
    assert handler.guard.check(d, new_task(site.url(path))).suspect
    settlement = handler.handle(d)
    assert (settlement.action, settlement.reason) == (Action.ACK, "fetched")
    assert site.hits(path) == 1 and store.list_dead(task_ids=[task_id]) == []
    assert store.quarantined(task_id) is None, "a survived quarantine run leaves no row"


def test_a_suspect_waits_for_running_fetches_and_new_ones_wait_for_it():
    """Isolation: alone() starts only once no shared fetch runs, and shared ones that
    come meanwhile start only after it (the wake-ups it relies on are conditional)."""
    isolation = Isolation()
    order: list[str] = []
    first_in, release_first = threading.Event(), threading.Event()

    def shared(name: str, hold: threading.Event | None = None) -> None:
        with isolation.shared():
            order.append(name)
            if hold is not None:
                first_in.set()
                hold.wait(10)

    def alone() -> None:
        with isolation.alone():
            order.append("suspect")
            time.sleep(0.2)

    running = threading.Thread(target=shared, args=("running", release_first))
    running.start()
    assert first_in.wait(10)
    suspect = threading.Thread(target=alone)
    suspect.start()
    time.sleep(0.2)
    later = threading.Thread(target=shared, args=("later",))
    later.start()
    time.sleep(0.2)
    assert order == ["running"], "the suspect waits for the running fetch, the later one for the suspect"
    release_first.set()
    for t in (running, suspect, later):
        t.join(10)
    assert order == ["running", "suspect", "later"]


def test_store_counted_redeliveries_hit_the_delivery_limit(make_handler, store, site):
    """Classic AMQP queues keep no counter: the handler counts crash redeliveries itself."""
    handler = make_handler(counts_deliveries=False)
    path = f"/fast/{_key()}"
    task_id = new_task(site.url(path)).task_id
    for _ in range(MAX_DELIVER - 1):
        store.bump_redelivery(task_id)          # earlier copies died with their worker
    _, d = task_delivery(site.url(path), redelivered=True)
    task = new_task(site.url(path))
    assert handler.guard.check(d, task).suspect
    store.bump_redelivery(task_id, delta=-1)    # undo the check's own count
    assert handler.handle(d).action is Action.ACK and site.hits(path) == 1


def _dead_worker() -> str:
    """The ``host:pid`` of a worker that is gone: a process that ran and was reaped."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    return f"{socket.gethostname()}:{gone.pid}"


def _killed_alone(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "suspect_killed_alone"]


def test_first_lone_death_runs_the_suspect_alone_again(make_handler, store, site):
    """A quarantine row left by a dead worker is one lone death, not proof (an outside
    SIGKILL may have hit a healthy suspect): counted, logged, and the task runs alone again."""
    path = f"/fast/{_key()}"
    task_id, d = task_delivery(site.url(path), redelivered=True, broker_redeliveries=MAX_DELIVER + 1)
    worker = _dead_worker()
    store.quarantine_begin(task_id, worker)
    handler = make_handler()
    with capture_logs() as logs:
        guard = handler.guard.check(d, new_task(site.url(path)))
    assert guard.suspect and guard.dead is None
    [event] = _killed_alone(logs)
    assert (event["task_id"], event["deaths"], event["worker"]) == (task_id, 1, worker)
    assert event["url"] == site.url(path) and event["attempt"] == 1
    assert store.quarantined(task_id)["deaths"] == 1
    settlement = handler.handle(d)          # alone again, and this time it survives
    assert (settlement.action, settlement.reason) == (Action.ACK, "fetched")
    assert site.hits(path) == 1 and store.list_dead(task_ids=[task_id]) == []
    assert store.quarantined(task_id) is None, "a survived run forgets the death"


def test_second_lone_death_is_dead_as_poison_without_a_fetch(make_handler, store, site):
    """LONE_DEATHS lone runs that killed their worker: the next copy is dead as poison."""
    path = f"/fast/{_key()}"
    task_id, d = task_delivery(site.url(path), redelivered=True, broker_redeliveries=MAX_DELIVER + 2)
    handler = make_handler()
    store.quarantine_begin(task_id, _dead_worker())
    assert handler.guard.check(d, new_task(site.url(path))).suspect
    store.quarantine_begin(task_id, _dead_worker())     # its second run alone, killed too
    with capture_logs() as logs:
        settlement = handler.handle(d)
    assert (settlement.action, settlement.reason) == (Action.DEAD, Reason.POISON)
    assert settlement.error == f"killed its worker in {LONE_DEATHS} runs alone"
    assert settlement.error == "killed its worker in 2 runs alone"
    assert _killed_alone(logs) == [], "the final death is the dead row, not a warning"
    assert site.hits(path) == 0
    [dead] = store.list_dead(task_ids=[task_id])
    assert (dead.reason, dead.error) == ("poison", settlement.error)
    assert store.quarantined(task_id)["deaths"] == LONE_DEATHS


def test_a_lone_death_is_counted_once_when_checked_twice(make_handler, store, site):
    """Two copies of the task finding the row (two workers, or one check run again): one
    death, one event, and both copies are suspects that run alone, neither is dead."""
    path = f"/fast/{_key()}"
    task_id, d = task_delivery(site.url(path), redelivered=True, broker_redeliveries=MAX_DELIVER + 1)
    store.quarantine_begin(task_id, _dead_worker())
    first, second = make_handler(), make_handler()
    with capture_logs() as logs:
        guards = [h.guard.check(d, new_task(site.url(path))) for h in (first, second, first)]
    assert [(g.suspect, g.dead) for g in guards] == [(True, None)] * 3
    assert len(_killed_alone(logs)) == 1
    assert store.quarantined(task_id)["deaths"] == 1 and store.quarantined(task_id)["worker"] == ""


def test_quarantine_row_of_a_live_worker_is_not_poison(make_handler, store, site):
    """A run that ended in a store error left its row, but its worker lives: run it again."""
    path = f"/fast/{_key()}"
    task_id, d = task_delivery(site.url(path), redelivered=True, broker_redeliveries=MAX_DELIVER)
    store.quarantine_begin(task_id, f"{socket.gethostname()}:{os.getpid()}")
    assert make_handler().handle(d).action is Action.ACK and site.hits(path) == 1
    assert store.quarantined(task_id) is None


def test_jetstream_style_redelivery_is_not_counted_twice(make_handler, store, site):
    """With counts_deliveries the attempt already includes crashes: no store counter."""
    path = f"/fast/{_key()}"
    task_id, d = task_delivery(site.url(path), attempt=2, redelivered=True)
    assert make_handler(counts_deliveries=True).handle(d).action is Action.ACK
    assert store.bump_redelivery(task_id) == 1


@pytest.mark.parametrize("body, reason", [
    (b"not json", "malformed:not_json"),
    (b"\xff\xfe", "malformed:invalid_utf8"),
    (b'{"nourl": true}', "malformed:no_url"),
    (b'{"url": 7}', "malformed:bad_types"),
])
def test_malformed_message_is_dead_at_once(make_handler, store, body, reason):
    settlement = make_handler().handle(delivery(body))
    assert (settlement.action, settlement.reason) == (Action.DEAD, reason)
    assert settlement.task is None
    [dead] = store.query("SELECT task_id, reason, url FROM dead")
    assert dead[0].startswith("malformed-") and dead[1:] == (reason, "")


def test_a_delivery_is_parsed_once_and_a_malformed_one_every_time(make_handler, store, site, monkeypatch):
    """The site gate parses on the I/O thread; the handler reuses that task. A malformed
    body is not cached: the handler parses it again and dead-letters it with its reason."""
    import crawld.pipeline.handler as handler_module
    calls = []
    real = handler_module.parse_message
    monkeypatch.setattr(handler_module, "parse_message", lambda *a: calls.append(a) or real(*a))
    handler = make_handler()
    task_id, d = task_delivery(site.url(f"/fast/{_key()}"))
    assert handler.parse(d).task_id == task_id          # what the worker's gate does first
    assert handler.handle(d).action is Action.ACK
    assert len(calls) == 1 and store.get_result(task_id)["status"] == "fetched"
    bad = delivery(b'{"nourl": true}', message_id="m-2")
    with pytest.raises(handler_module.MalformedMessage):
        handler.parse(bad)
    settlement = handler.handle(bad)
    assert (settlement.action, settlement.reason) == (Action.DEAD, "malformed:no_url")
    assert len(calls) == 3


def test_malformed_message_keeps_its_message_id(make_handler, store):
    settlement = make_handler().handle(delivery(b"not json", message_id="m-1"))
    assert settlement.action is Action.DEAD
    assert store.query("SELECT task_id FROM dead") == [("m-1",)]


def test_bug_in_our_code_is_dead_not_retried(make_handler, store, site):
    class Bug(Middleware):
        def before_store(self, delivery: Delivery, task: Any) -> None:
            raise RuntimeError("bug in our code")

    task_id, d = task_delivery(site.url(f"/fast/{_key()}"))
    settlement = make_handler(middleware=Bug()).handle(d)
    assert (settlement.action, settlement.reason) == (Action.DEAD, Reason.INTERNAL_ERROR)
    assert "bug in our code" in settlement.error
    assert store.get_result(task_id) is None
    assert store.list_dead(task_ids=[task_id])[0].reason == "internal_error"


# -- RELEASE ----------------------------------------------------------------------------
def test_release_forgives_the_redelivery_it_causes(make_handler, store, site):
    task_id, d = task_delivery(site.url(f"/fast/{_key()}"))
    handler = make_handler(counts_deliveries=False)
    settlement = handler.release(d)
    assert (settlement.action, settlement.reason) == (Action.RELEASE, Reason.DRAINING)
    handler.guard.flush()
    # the broker redelivers it flagged redelivered: that one is forgiven, so even with
    # MAX_DELIVER - 1 crashes before it the copy is no suspect
    for _ in range(MAX_DELIVER - 1):
        store.bump_redelivery(task_id)
    again = delivery(d.body, redelivered=True)
    assert store.forgiven(task_id) == 1
    assert not handler.guard.check(again, new_task(json.loads(d.body)["url"])).suspect
    assert store.get_result(task_id) is None and store.list_dead(task_ids=[task_id]) == []


class ListTransport(Transport):
    """In-memory transport: hands out a fixed list of deliveries, records settlements.
    ``on_poll`` runs on every poll (the worker's main thread), like broker I/O would."""

    name = "list"
    counts_deliveries = False

    def __init__(self, deliveries: list[Delivery], on_poll: Callable[[], None]) -> None:
        self.deliveries = deliveries
        self.on_poll = on_poll
        self.settled: list[tuple[Delivery, Settlement]] = []
        self.closed = False

    def connect(self) -> None:
        pass

    def start_consuming(self, on_delivery: Callable[[Delivery], None], free_slots: Callable[[], int]) -> None:
        for d in self.deliveries:      # push, as AMQP does up to its prefetch
            on_delivery(d)

    def poll(self, timeout: float) -> None:
        self.on_poll()
        time.sleep(min(timeout, 0.05))

    def settle(self, delivery: Delivery, settlement: Settlement) -> None:
        self.settled.append((delivery, settlement))
        if settlement.event is not None:     # a broker that confirms every event at once
            self.event_settled(delivery, dataclasses.replace(settlement, event=None))

    def stop_consuming(self) -> None:
        pass

    def pending_settlements(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


def test_worker_drain_releases_the_unstarted_and_finishes_the_started(cfg, store, fetcher, site):
    """One thread, two deliveries: the running fetch is finished and acked, the queued
    one is given back (RELEASE) at once, and its redelivery will not count as a crash."""
    key = _key()
    running_id, running = task_delivery(site.url(f"/slow/3/{key}-a"))
    queued_id, queued = task_delivery(site.url(f"/fast/{key}-b"))
    worker: Worker

    def sigterm_once_fetching() -> None:
        if site.total_hits(f"/slow/3/{key}"):
            worker._on_drain_signal(15, None)      # what SIGTERM's handler does

    transport = ListTransport([running, queued], sigterm_once_fetching)
    worker = Worker(cfg, transport, store, fetcher, worker_id="test:2")
    assert worker.run() == 0
    got = {d.message_id: s for d, s in transport.settled}
    assert (got[running_id].action, got[running_id].reason) == (Action.ACK, "fetched")
    assert (got[queued_id].action, got[queued_id].reason) == (Action.RELEASE, "draining")
    assert len(transport.settled) == 2 and transport.closed
    assert store.get_result(running_id)["writes"] == 1 and store.get_result(queued_id) is None
    assert site.total_hits(f"/fast/{key}") == 0
    assert store.forgiven(queued_id) == 1, "its redelivery will not count as a crash"
    assert worker.state.state is Phase.STOPPED and worker.state.done == 1
    assert worker.state.inflight == 0


# -- the middleware seam ----------------------------------------------------------------
def test_chain_calls_members_in_config_order():
    first, second = Recorder(), Recorder()
    chain = MiddlewareChain([first, second])
    d = delivery(b"{}")
    chain.before_settle(d, Settlement(Action.ACK))
    assert first.calls == second.calls == ["before_settle:ack"]


@pytest.mark.parametrize("hook", HOOKS)
def test_chain_fans_out_every_hook(hook):
    calls: list[tuple[str, tuple]] = []

    class Spy(Middleware):
        def __getattribute__(self, name: str) -> Any:
            if name in HOOKS:
                return lambda *args: calls.append((name, args))
            return super().__getattribute__(name)

    getattr(MiddlewareChain([Spy(), Spy()]), hook)("a", "b")
    assert calls == [(hook, ("a", "b"))] * 2
    assert set(HOOKS) == {"after_worker_boot", "on_tick", "before_fetch", "before_store",
                          "after_store", "before_settle"}


def test_load_middleware_builds_each_entry_once():
    chain = load_middleware(["faults:FaultMiddleware", "crawld.pipeline.middleware:Middleware"])
    assert [type(m) for m in chain.members] == [FaultMiddleware, Middleware]


@pytest.mark.parametrize("spec, words", [
    ("no_colon", "not of the form"),
    ("nosuchmodule_xyz:Thing", "cannot import"),
    ("crawld.pipeline.middleware:NoSuchThing", "cannot import"),
    ("crawld.pipeline.outcomes:MALFORMED_PREFIX", "not callable"),
    ("os:getcwd", "not a Middleware"),
])
def test_bad_middleware_entry_is_a_config_error_naming_the_key(spec, words):
    with pytest.raises(ConfigError) as err:
        load_middleware([spec])
    assert str(err.value).startswith("pipeline.middleware: ") and words in str(err.value)


def test_middleware_key_from_file_and_env(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[pipeline]\nmiddleware = ["crawld.pipeline.middleware:Middleware"]\n')
    assert load_config(str(path), env={}).pipeline.middleware == ("crawld.pipeline.middleware:Middleware",)
    env = {"CRAWLD_PIPELINE_MIDDLEWARE": json.dumps(["faults:FaultMiddleware"])}
    assert load_config(str(path), env=env).pipeline.middleware == ("faults:FaultMiddleware",)


def test_check_config_exits_2_on_an_unimportable_middleware(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[pipeline]\nmiddleware = ["nosuchmodule_xyz:Thing"]\n')
    done = subprocess.run([sys.executable, "-m", "crawld", "check-config", "-c", str(path)],
                          capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1
    assert "pipeline.middleware" in lines[0] and "Traceback" not in done.stderr


def test_fault_middleware_is_injected_only_when_a_fault_is_asked_for():
    assert "CRAWLD_PIPELINE_MIDDLEWARE" not in with_fault_middleware({"PYTHONPATH": "/x"})
    env = with_fault_middleware({"CRAWLD_TEST_FAULT": "after_store", "PYTHONPATH": "/x"})
    assert json.loads(env["CRAWLD_PIPELINE_MIDDLEWARE"]) == ["faults:FaultMiddleware"]
    tests_dir = str(Path(__file__).resolve().parent)
    assert env["PYTHONPATH"].split(":") == [tests_dir, "/x"]
