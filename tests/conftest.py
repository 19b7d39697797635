"""Shared fixtures: real servers, started lazily (only when a test asks) once per session."""
from __future__ import annotations

import os
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import NatsServer, PostgresServer, RabbitNode, make_config, running_rabbit  # noqa: E402

from crawld.devtools.testsite import TestSite  # noqa: E402


def _interrupt_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    # `timeout 300 pytest ...` sends SIGTERM, which by default kills Python without running
    # fixture teardown or atexit: the broker nodes (own sessions) would be left running.
    # As a KeyboardInterrupt, pytest tears the session fixtures down properly.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt_on_sigterm)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test that ran crawld gets each installation's log digest in its report: a
    failure on a CI machine is then explained by what the daemon did, not only by a timeout."""
    outcome = yield
    report = outcome.get_result()
    factory = getattr(item, "funcargs", {}).get("make_crawld")
    if report.when != "call" or not report.failed or factory is None:
        return
    for n, daemon in enumerate(getattr(factory, "made", []), 1):
        try:
            digest = daemon.log_digest()
        except Exception as exc:        # the report must not fail on a broken log
            digest = f"no digest: {exc!r}"
        report.sections.append((f"crawld installation {n}: log digest", digest))


# -- servers (session scope: pytest only builds a fixture when some test requests it) ----
@pytest.fixture(scope="session")
def rabbit() -> Iterator[RabbitNode]:
    with running_rabbit() as node:
        yield node


@pytest.fixture(scope="session")
def nats() -> Iterator[NatsServer]:
    server = NatsServer(monitor=True)
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def js_server() -> Iterator[NatsServer]:
    """A nats-server of the test's own: JetStream state (streams, durables, leases) that a
    test breaks or restarts must not leak into the next test."""
    server = NatsServer()
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def site() -> Iterator[TestSite]:
    with TestSite() as test_site:
        yield test_site


@pytest.fixture(scope="session")
def sites(site: TestSite) -> Iterator[list[TestSite]]:
    """Ten sites for the partitioned fleet: ``site`` plus nine more on other loopback
    addresses (politeness and shards key on the host name, never the port). With 64
    shards their hosts land in ten different shards, so 2 or 5 workers get equal shares."""
    others = [TestSite(host=f"127.0.0.{n}").start() for n in range(2, 11)]
    try:
        yield [site, *others]
    finally:
        for other in others:
            other.stop()


# -- per-test isolation ---------------------------------------------------------------
@pytest.fixture
def queue_name() -> str:
    """A unique queue / durable consumer name, valid for AMQP and JetStream."""
    return f"t{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class StorePaths:
    url: str        # sqlite:////abs/path/crawld.db
    path: Path      # the database file
    body_dir: Path  # content-addressed body directory
    warc_dir: Path  # WARC files (store.bodies = "warc", the default)


@pytest.fixture
def tmp_store(tmp_path: Path) -> StorePaths:
    db = tmp_path / "crawld.db"
    body_dir = tmp_path / "bodies"
    body_dir.mkdir()
    return StorePaths(url=f"sqlite:///{db}", path=db, body_dir=body_dir, warc_dir=tmp_path / "warc")


@pytest.fixture
def crawld_env(request: pytest.FixtureRequest, tmp_path: Path, tmp_store: StorePaths,
               queue_name: str) -> Callable[..., Path]:
    """Factory writing a crawld TOML config in tmp_path; returns the file's path.

    ``crawld_env(transport="jetstream", workers={"count": 1}, fetch={...})``. Defaults: the
    test's tmp_store, its unique queue_name, loopback allowed by the SSRF guard. Without
    ``broker_url`` the matching session broker (rabbit or nats) is started and used.
    """

    def build(*, broker_url: str | None = None, transport: str = "amqp",
              filename: str = "crawld.toml", **sections: dict[str, Any]) -> Path:
        if broker_url is None and transport == "jetstream":
            # CRAWL is a WorkQueue stream: one durable per subject filter per server, so
            # every test gets its own nats-server (it starts in a few ms).
            server = NatsServer()
            server.start()
            request.addfinalizer(server.close)
            broker_url = server.url
        rabbit = None
        if broker_url is None and transport != "jetstream":
            rabbit = request.getfixturevalue("rabbit")
            broker_url = rabbit.url
        sections["queue"] = {"name": queue_name, **sections.get("queue", {})}
        sections["store"] = {"url": tmp_store.url, "body_dir": str(tmp_store.body_dir),
                             "warc_dir": str(tmp_store.warc_dir), **sections.get("store", {})}
        path = make_config(tmp_path, broker_url=broker_url, transport=transport,
                           filename=filename, **sections)
        if rabbit is not None:      # the session node: drop this test's 70-odd queues after it
            request.addfinalizer(lambda: rabbit.delete_topology(path))
        return path

    return build


@pytest.fixture
def make_crawld(crawld_env: Callable[..., Path]) -> Iterator[Callable[..., Any]]:
    """Factory of ``Crawld`` installations (a config file each) for end-to-end tests.

    ``make_crawld("jetstream", env={...}, broker_url=..., workers={...}, queue={...})``:
    JSON logs, loopback allowed, politeness loose enough not to serialise the local
    site, a 20 s drain. Every supervisor started is killed at teardown.
    """
    from crawld_proc import Crawld
    made: list[Crawld] = []

    def build(transport: str = "amqp", env: dict[str, str] | None = None,
              broker_url: str | None = None, **sections: dict[str, Any]) -> Crawld:
        sections.setdefault("log", {"format": "json"})
        sections["fetch"] = {"per_host_concurrency": 64, "allow_networks": ["127.0.0.0/8"],
                             **sections.get("fetch", {})}
        sections["workers"] = {"drain_timeout_s": 20, **sections.get("workers", {})}
        daemon = Crawld(crawld_env(transport=transport, broker_url=broker_url, **sections), env=env)
        made.append(daemon)
        return daemon

    build.made = made       # type: ignore[attr-defined]  # for pytest_runtest_makereport
    yield build
    for daemon in made:
        daemon.close()
