"""Command line: `crawld run | worker | publish | crawl | status | reconcile | dlq | show | demo | check-config`.

Exit codes: 0 ok; 1 the check found a problem (lost tasks, unconfirmed publishes);
2 bad usage or config (one line on stderr, no traceback).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Sequence

from crawld import __version__
from crawld.config import Config, ConfigError, load_config, redact_url
from crawld.logs import get_logger, setup_logging

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2
STORE_CHECK_WAIT_S = 2.0     # `crawld run`: how long the start-up store check retries a refusal


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:   # argparse's default prints usage + exits 2
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="crawld", description="Distributed crawl fetch-worker daemon.")
    parser.add_argument("--version", action="version", version=f"crawld {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def cmd(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("-c", "--config", help="TOML config (default etc/crawld.toml if present)")
        return p

    p = cmd("run", "Run the supervisor and its workers in the foreground.")
    p.add_argument("--workers", type=int, help="worker processes (overrides workers.count)")
    p.add_argument("--transport", choices=["amqp", "jetstream"])
    p.add_argument("--broker", help="broker URL (overrides broker.url)")
    p = cmd("worker", "Run one worker in the foreground (supervisord numprocs mode).")
    p.add_argument("--transport", choices=["amqp", "jetstream"])
    p.add_argument("--broker", help="broker URL (overrides broker.url)")
    p = cmd("publish", "Publish URLs (one per line, or JSON lines) through the outbox.")
    p.add_argument("file", help="file of URLs, or - for stdin")
    p.add_argument("--round", default="0", help="crawl round; part of the task id")
    p.add_argument("--no-declare", action="store_true",
                   help="do not declare queues/streams (publish fails if they are missing)")
    p.add_argument("--transport", choices=["amqp", "jetstream"])
    p.add_argument("--broker", help="broker URL (overrides broker.url)")
    p = cmd("crawl", "Publish seed URLs (depth 0) through the outbox; the workers' hooks "
                     "discover the rest within the scope given here (flags override [scope]).")
    p.add_argument("urls", nargs="+", metavar="URL")
    p.add_argument("--round", default="0", help="crawl round; part of every task id")
    p.add_argument("--source", default="crawl", help="source label of the seeds and their links")
    p.add_argument("--same-site", action=argparse.BooleanOptionalAction, default=None,
                   help="follow links to the page's own host only (scope.same_site)")
    p.add_argument("--allowed-domain", dest="allowed_domains", action="append", metavar="DOMAIN",
                   help="follow links to this domain and its subdomains (repeatable)")
    p.add_argument("--max-depth", type=int, metavar="N", help="fetch pages at depth <= N (0 = no limit)")
    p.add_argument("--allow", action="append", metavar="REGEX", help="URLs must match one (repeatable)")
    p.add_argument("--deny", action="append", metavar="REGEX", help="URLs must match none (repeatable)")
    p.add_argument("--max-links-per-page", type=int, metavar="N")
    p.add_argument("--no-declare", action="store_true",
                   help="do not declare queues/streams (publish fails if they are missing)")
    p.add_argument("--transport", choices=["amqp", "jetstream"])
    p.add_argument("--broker", help="broker URL (overrides broker.url)")
    p = cmd("status", "Workers, queue depths and store counts.")
    p.add_argument("--json", action="store_true")
    p = cmd("reconcile", "Find confirmed tasks that are neither done nor dead (lost).")
    p.add_argument("--json", action="store_true")
    p.add_argument("--grace", type=float, default=0.0, metavar="S",
                   help="ignore tasks confirmed less than S seconds ago (still in flight)")
    p = cmd("show", "Print a stored page: its result row and its body (from the WARC file).")
    p.add_argument("task_id")
    p.add_argument("--json", action="store_true")
    p.add_argument("--body", action="store_true", help="print the body after the metadata")
    p.add_argument("--body-only", action="store_true", help="write only the raw body to stdout")
    p.add_argument("--headers", action="store_true", help="print the stored HTTP response headers")
    p = cmd("check-config", "Validate a config file and print the effective values.")
    p.add_argument("--json", action="store_true")
    dlq = sub.add_parser("dlq", help="Dead-letter queue: list or replay.")
    dlq_sub = dlq.add_subparsers(dest="dlq_command", required=True, parser_class=_Parser)
    p = dlq_sub.add_parser("list", help="List dead tasks (newest first).")
    p.add_argument("-c", "--config")
    p.add_argument("--json", action="store_true")
    p.add_argument("--limit", type=int, default=50)
    p = dlq_sub.add_parser("replay", help="Publish dead tasks into the work queue again.")
    p.add_argument("-c", "--config")
    p.add_argument("--all", action="store_true", help="replay every dead task")
    p.add_argument("ids", nargs="*", metavar="ID")
    p = sub.add_parser("demo", help="Self-contained demo: nats-server, local site, 2 workers.")
    p.add_argument("--dir", help="keep the store and logs here (default: a temp dir)")
    p.add_argument("--transport", choices=["jetstream", "amqp"], default="jetstream")
    p.add_argument("--tasks", type=int, default=100)
    p.add_argument("--workers", type=int, default=2)
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = load_config(getattr(args, "config", None))
    if getattr(args, "transport", None):
        cfg = cfg.replace("broker", transport=args.transport)
        if not getattr(args, "broker", None) and args.transport == "jetstream" and cfg.broker.url.startswith("amqp"):
            cfg = cfg.replace("broker", url="nats://127.0.0.1:4222")
    if getattr(args, "broker", None):
        cfg = cfg.replace("broker", url=args.broker)
    if getattr(args, "workers", None) is not None and args.command == "run":
        if args.workers < 0:
            raise ConfigError("--workers: must be >= 0")
        cfg = cfg.replace("workers", count=args.workers)
    from crawld.config import validate
    validate(cfg)
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        handler = COMMANDS[args.command]
        if args.command == "demo":
            return handler(args, None)
        cfg = config_from_args(args)
        return handler(args, cfg)
    except (UsageError, ConfigError) as exc:
        print(f"crawld: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def _open_store(cfg: Config) -> Any:
    from crawld.store import open_store
    try:
        return open_store(cfg.store)
    except Exception as exc:
        raise ConfigError(f"store.url: cannot open {redact_url(cfg.store.url)}: {exc}") from None


def check_store_at_start(cfg: Config) -> None:
    """A wrong store (no such database, bad password) is a config error: exit 2. A store
    that is only not up yet (PostgreSQL still starting at host boot) is not: the workers
    wait for it, paused (process/boot.py)."""
    from crawld.process.boot import store_not_ready
    from crawld.store import open_store
    try:
        open_store(cfg.store, connect_wait_s=STORE_CHECK_WAIT_S).close()
    except Exception as exc:
        if not store_not_ready(exc, cfg.store.url):
            raise ConfigError(f"store.url: cannot open {redact_url(cfg.store.url)}: {exc}") from None
        get_logger("crawld.supervisor").warning("store_not_ready", store_url=redact_url(cfg.store.url),
                                                error=" ".join(str(exc).split())[:300],
                                                workers="wait for it, paused")


def cmd_run(args: argparse.Namespace, cfg: Config) -> int:
    from crawld.process.supervisor import Supervisor
    setup_logging(cfg.log, "supervisor")
    check_store_at_start(cfg)         # fail fast (exit 2) on a bad store, before forking

    def reload() -> Config:
        return config_from_args(args)
    return Supervisor(cfg, reload).run()


def cmd_worker(args: argparse.Namespace, cfg: Config) -> int:
    from crawld.process.worker import run_worker
    setup_logging(cfg.log, "worker")
    return run_worker(cfg)


def cmd_publish(args: argparse.Namespace, cfg: Config) -> int:
    from crawld.ops.publish import publish_file, terminal_progress
    setup_logging(cfg.log, "publish")
    store = _open_store(cfg)
    try:
        stream = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"{args.file}: {exc.strerror}") from None
    with stream:
        summary = publish_file(cfg, store, stream, args.round, terminal_progress(),
                               declare=not args.no_declare)
    store.close()
    print(f"read {summary.read}  new {summary.new}  invalid {summary.invalid}  "
          f"published {summary.published}  confirmed {summary.confirmed}  failed {summary.failed}")
    for task_id, reason in list(summary.failures.items())[:10]:
        print(f"  unconfirmed {task_id}: {reason}")
    return EXIT_OK if summary.ok else EXIT_PROBLEM


def cmd_crawl(args: argparse.Namespace, cfg: Config) -> int:
    from crawld.ops.crawl import publish_seeds
    from crawld.ops.publish import terminal_progress
    from crawld.pipeline.scope import overrides_json
    setup_logging(cfg.log, "crawl")
    scope_json = overrides_json({"same_site": args.same_site, "allowed_domains": args.allowed_domains,
                                 "max_depth": args.max_depth, "allow": args.allow, "deny": args.deny,
                                 "max_links_per_page": args.max_links_per_page})
    if not cfg.pipeline.hooks:
        get_logger("crawld.crawl").warning("no_hooks", key="pipeline.hooks",
                                           note="workers fetch the seeds but discover nothing")
    store = _open_store(cfg)
    try:
        summary = publish_seeds(cfg, store, args.urls, args.round, scope_json, args.source,
                                terminal_progress(), declare=not args.no_declare)
    finally:
        store.close()
    print(f"seeds {summary.read}  new {summary.new}  invalid {summary.invalid}  "
          f"published {summary.published}  confirmed {summary.confirmed}  failed {summary.failed}")
    for task_id, reason in list(summary.failures.items())[:10]:
        print(f"  unconfirmed {task_id}: {reason}")
    return EXIT_OK if summary.ok and not summary.invalid else EXIT_PROBLEM


def cmd_status(args: argparse.Namespace, cfg: Config) -> int:
    from crawld.ops.status import collect, format_status
    setup_logging(cfg.log, "status")
    store = _open_store(cfg)
    report = collect(cfg, store)
    store.close()
    print(json.dumps(report, indent=2, default=str) if args.json else format_status(report))
    return EXIT_OK


def cmd_reconcile(args: argparse.Namespace, cfg: Config) -> int:
    from crawld.ops.reconcile import format_reconciliation, reconcile
    setup_logging(cfg.log, "reconcile")
    store = _open_store(cfg)
    rec = reconcile(store, args.grace)
    store.close()
    print(json.dumps(rec.as_dict(), indent=2) if args.json else format_reconciliation(rec))
    return EXIT_OK if rec.ok else EXIT_PROBLEM


def cmd_dlq(args: argparse.Namespace, cfg: Config) -> int:
    from dataclasses import asdict

    from crawld.ops.dlq import format_dead, replay
    setup_logging(cfg.log, "dlq")
    store = _open_store(cfg)
    try:
        if args.dlq_command == "list":
            rows = store.list_dead(limit=args.limit)
            print(json.dumps([asdict(r) for r in rows], indent=2) if args.json else format_dead(rows))
            return EXIT_OK
        if not args.all and not args.ids:
            raise UsageError("dlq replay: give task ids or --all")
        report = replay(cfg, store, None if args.all else args.ids)
    finally:
        store.close()
    print(f"replayed {len(report.replayed)}  failed {len(report.failed)}  "
          f"not dead {len(report.not_dead)}  unreplayable {len(report.unreplayable)}")
    for task_id, reason in {**report.failed, **report.unreplayable}.items():
        print(f"  {task_id}: {reason}")
    for task_id in report.not_dead:
        print(f"  {task_id}: not in the dead-letter list")
    return EXIT_OK if not report.failed else EXIT_PROBLEM


def cmd_show(args: argparse.Namespace, cfg: Config) -> int:
    from crawld.ops.show import format_page, load_page, page_json
    setup_logging(cfg.log, "show")
    store = _open_store(cfg)
    try:
        page = load_page(cfg, store, args.task_id)
    except (OSError, ValueError) as exc:
        print(f"crawld: {args.task_id}: cannot read the stored body: {exc}", file=sys.stderr)
        return EXIT_PROBLEM
    finally:
        store.close()
    if page is None:
        print(f"crawld: {args.task_id}: no result stored", file=sys.stderr)
        return EXIT_PROBLEM
    if args.body_only:
        sys.stdout.buffer.write(page.body or b"")
        return EXIT_OK
    if args.json:
        print(page_json(page, args.body))
        return EXIT_OK
    print(format_page(page, args.headers))
    if args.body and page.body is not None:
        sys.stdout.write("\n")
        sys.stdout.flush()
        sys.stdout.buffer.write(page.body)
    return EXIT_OK


def cmd_check_config(args: argparse.Namespace, cfg: Config) -> int:
    from dataclasses import asdict
    data = asdict(cfg)
    data["broker"]["url"] = redact_url(cfg.broker.url)
    data["store"]["url"] = redact_url(cfg.store.url)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(f"config ok: {cfg.source_path or '(defaults + environment)'}")
        for section, values in data.items():
            if isinstance(values, dict):
                for key, value in values.items():
                    print(f"  {section}.{key} = {value!r}")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace, _cfg: Config | None) -> int:
    from crawld.devtools.demo import run_demo
    return run_demo(args)


COMMANDS: dict[str, Callable[[argparse.Namespace, Any], int]] = {
    "run": cmd_run, "worker": cmd_worker, "publish": cmd_publish, "crawl": cmd_crawl, "status": cmd_status,
    "reconcile": cmd_reconcile, "dlq": cmd_dlq, "show": cmd_show, "check-config": cmd_check_config, "demo": cmd_demo,
}
