"""Configuration: one TOML file, every key overridable by ``CRAWLD_<SECTION>_<KEY>``.

The dataclass defaults below are the single source of truth for every key: the
example ``etc/crawld.toml`` and the README table are checked against them by a test.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import tempfile
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

DEFAULT_PATH = "etc/crawld.toml"
ENV_PREFIX = "CRAWLD_"


class ConfigError(ValueError):
    """A config problem, always naming the offending key."""


@dataclass(frozen=True)
class BrokerConfig:
    transport: str = "amqp"
    url: str = "amqp://guest:guest@127.0.0.1:5672/%2F"
    heartbeat_s: int = 30
    reconnect_max_s: float = 30.0


@dataclass(frozen=True)
class QueueConfig:
    name: str = "crawl"
    prefetch: int = 16
    ack_wait_s: float = 60.0
    max_deliver: int = 5
    retry_delays_s: tuple[float, ...] = (5.0, 60.0, 600.0)
    type: str = "classic"
    replicas: int = 1
    duplicate_window_s: float = 86400.0
    max_message_bytes: int = 65536
    max_ack_pending: int = 20000
    partition: str = "host"
    shards: int = 64


@dataclass(frozen=True)
class WorkersConfig:
    count: int = 2
    threads: int = 16
    drain_timeout_s: float = 30.0
    liveness_timeout_s: float = 60.0
    crash_limit: int = 10
    backoff_max_s: float = 30.0
    probe_max_s: float = 30.0
    pid_file: str = ""
    run_dir: str = ""


@dataclass(frozen=True)
class FetchConfig:
    timeout_s: float = 20.0
    connect_timeout_s: float = 10.0
    max_body_bytes: int = 10485760
    max_redirects: int = 5
    user_agent: str = "crawld/0.1 (+contact URL)"
    obey_robots: bool = True
    robots_cache_s: float = 86400.0
    per_host_concurrency: int = 2
    per_host_delay_s: float = 0.0
    retry_after_max_s: float = 3600.0
    allow_networks: tuple[str, ...] = ()
    dns_servers: tuple[str, ...] = ()
    breaker_window: int = 20
    breaker_ratio: float = 0.8
    breaker_min_sites: int = 3


@dataclass(frozen=True)
class StoreConfig:
    url: str = "sqlite:///var/lib/crawld/crawld.db"
    body_dir: str = "/var/lib/crawld/bodies"
    bodies: str = "warc"
    warc_dir: str = ""
    warc_max_bytes: int = 1 << 30
    lock_wait_s: float = 60.0


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"
    format: str = "auto"


@dataclass(frozen=True)
class MetricsConfig:
    port: int = 0
    host: str = "127.0.0.1"


@dataclass(frozen=True)
class PipelineConfig:
    middleware: tuple[str, ...] = ()
    hooks: tuple[str, ...] = ()


@dataclass(frozen=True)
class ScopeConfig:
    """Which discovered URLs become tasks (pipeline/scope.py). ``crawld crawl`` flags
    override these per crawl: the seeds carry the overrides to every worker."""
    same_site: bool = True
    allowed_domains: tuple[str, ...] = ()
    max_depth: int = 0                 # 0 = no limit (Scrapy's DEPTH_LIMIT convention)
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    max_links_per_page: int = 1000


@dataclass(frozen=True)
class OutputConfig:
    events: bool = True


@dataclass(frozen=True)
class Config:
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    fetch: FetchConfig = field(default_factory=FetchConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    log: LogConfig = field(default_factory=LogConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    scope: ScopeConfig = field(default_factory=ScopeConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    source_path: str = ""

    def replace(self, section: str, **changes: Any) -> "Config":
        """A copy with some keys of one section changed (used by CLI flags)."""
        new_section = dataclasses.replace(getattr(self, section), **changes)
        return dataclasses.replace(self, **{section: new_section})


SECTIONS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in fields(Config)
    if f.name != "source_path"
}


def load_config(path: str | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Read ``path`` (or the default path if it exists), apply env overrides, validate."""
    env = os.environ if env is None else env
    raw = _read_toml(path)
    _apply_env(raw, env)
    sections = {name: _build_section(name, cls, raw.get(name, {})) for name, cls in SECTIONS.items()}
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown section [{unknown[0]}]")
    cfg = Config(**sections, source_path=os.path.abspath(path) if path else "")
    validate(cfg)
    return cfg


def _read_toml(path: str | None) -> dict[str, Any]:
    if path is None:
        if not os.path.exists(DEFAULT_PATH):
            return {}
        path = DEFAULT_PATH
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: invalid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    for name, cls in SECTIONS.items():
        for f in fields(cls):
            var = f"{ENV_PREFIX}{name.upper()}_{f.name.upper()}"
            if var in env:
                raw.setdefault(name, {})[f.name] = _parse_env_value(var, env[var], f.default)


def _parse_env_value(var: str, text: str, default: Any) -> Any:
    if isinstance(default, bool):
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{var}: expected true/false, got {text!r}")
    if isinstance(default, tuple):
        text = text.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                raise ConfigError(f"{var}: expected a JSON list, got {text!r}") from None
        return [part.strip() for part in text.split(",") if part.strip()]
    return text  # converted and checked with the file values in _coerce


def _build_section(name: str, cls: type, values: Any) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"[{name}] must be a table")
    known = {f.name: f for f in fields(cls)}
    for key in values:
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key")
    kwargs = {key: _coerce(f"{name}.{key}", values[key], known[key].default) for key in values}
    return cls(**kwargs)


def _coerce(key: str, value: Any, default: Any) -> Any:
    try:
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise TypeError("expected true or false")
            return value
        if isinstance(default, int):
            return _to_number(value, int, "an integer")
        if isinstance(default, float):
            return _to_number(value, float, "a number")
        if isinstance(default, tuple):
            if not isinstance(value, (list, tuple)):
                raise TypeError("expected a list")
            item_type = float if key == "queue.retry_delays_s" else str
            return tuple(item_type(v) for v in value)
        if not isinstance(value, str):
            raise TypeError("expected a string")
        return value
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key}: {exc} (got {value!r})") from None


def _to_number(value: Any, kind: type, label: str) -> Any:
    if isinstance(value, bool):
        raise TypeError(f"expected {label}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"expected {label}") from None
    if kind is int and not number.is_integer():
        raise TypeError(f"expected {label}")
    return kind(number)


def validate(cfg: Config) -> None:
    """Check values that have a valid type but make no sense; name the key."""
    checks: list[tuple[bool, str]] = [
        (cfg.broker.transport in ("amqp", "jetstream"), "broker.transport: must be 'amqp' or 'jetstream'"),
        (_url_scheme_fits(cfg.broker), "broker.url: scheme does not match broker.transport"),
        (cfg.broker.heartbeat_s >= 0, "broker.heartbeat_s: must be >= 0"),
        (cfg.broker.reconnect_max_s > 0, "broker.reconnect_max_s: must be > 0"),
        (bool(cfg.queue.name) and "." not in cfg.queue.name.strip("."), "queue.name: must be a non-empty name without dots"),
        (cfg.queue.prefetch >= 1, "queue.prefetch: must be >= 1"),
        (cfg.queue.ack_wait_s >= 1, "queue.ack_wait_s: must be >= 1"),
        (cfg.queue.max_deliver >= 1, "queue.max_deliver: must be >= 1"),
        (all(d > 0 for d in cfg.queue.retry_delays_s), "queue.retry_delays_s: delays must be > 0"),
        (list(cfg.queue.retry_delays_s) == sorted(cfg.queue.retry_delays_s), "queue.retry_delays_s: must be ascending"),
        (cfg.queue.type in ("classic", "quorum"), "queue.type: must be 'classic' or 'quorum'"),
        (cfg.queue.replicas in (1, 3, 5), "queue.replicas: must be 1, 3 or 5"),
        (cfg.queue.max_message_bytes >= 256, "queue.max_message_bytes: must be >= 256"),
        (cfg.queue.max_ack_pending >= 1, "queue.max_ack_pending: must be >= 1"),
        (cfg.queue.partition in ("host", "domain", "none"), "queue.partition: must be 'host', 'domain' or 'none'"),
        (1 <= cfg.queue.shards <= 4096, "queue.shards: must be 1..4096"),
        (cfg.workers.count >= 0, "workers.count: must be >= 0"),
        (cfg.workers.threads >= 1, "workers.threads: must be >= 1"),
        (cfg.workers.drain_timeout_s >= 0, "workers.drain_timeout_s: must be >= 0"),
        (cfg.workers.liveness_timeout_s >= 1, "workers.liveness_timeout_s: must be >= 1"),
        (cfg.workers.crash_limit >= 1, "workers.crash_limit: must be >= 1"),
        (cfg.workers.backoff_max_s > 0, "workers.backoff_max_s: must be > 0"),
        (cfg.workers.probe_max_s > 0, "workers.probe_max_s: must be > 0"),
        (cfg.fetch.timeout_s > 0, "fetch.timeout_s: must be > 0"),
        (cfg.fetch.connect_timeout_s > 0, "fetch.connect_timeout_s: must be > 0"),
        (cfg.fetch.max_body_bytes > 0, "fetch.max_body_bytes: must be > 0"),
        (cfg.fetch.max_redirects >= 0, "fetch.max_redirects: must be >= 0"),
        (bool(cfg.fetch.user_agent.strip()), "fetch.user_agent: must not be empty"),
        (cfg.fetch.per_host_concurrency >= 1, "fetch.per_host_concurrency: must be >= 1"),
        (cfg.fetch.per_host_delay_s >= 0, "fetch.per_host_delay_s: must be >= 0"),
        (cfg.fetch.breaker_window >= 2, "fetch.breaker_window: must be >= 2"),
        (0 < cfg.fetch.breaker_ratio <= 1, "fetch.breaker_ratio: must be > 0 and <= 1"),
        (cfg.fetch.breaker_min_sites >= 2, "fetch.breaker_min_sites: must be >= 2"),
        (cfg.store.lock_wait_s > 0, "store.lock_wait_s: must be > 0"),
        (cfg.store.url.startswith(("sqlite:///", "postgresql://", "postgres://")), "store.url: must start with sqlite:/// or postgresql://"),
        (cfg.store.bodies in ("warc", "files", "none"), "store.bodies: must be 'warc', 'files' or 'none'"),
        (cfg.store.warc_max_bytes >= 1 << 20, "store.warc_max_bytes: must be >= 1048576 (1 MiB)"),
        (cfg.log.level.lower() in ("debug", "info", "warning", "error"), "log.level: must be debug, info, warning or error"),
        (cfg.log.format in ("json", "console", "auto"), "log.format: must be json, console or auto"),
        (0 <= cfg.metrics.port <= 65535, "metrics.port: must be 0..65535"),
        (cfg.scope.max_depth >= 0, "scope.max_depth: must be >= 0 (0 = no limit)"),
        (cfg.scope.max_links_per_page >= 1, "scope.max_links_per_page: must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    for cidr in cfg.fetch.allow_networks:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise ConfigError(f"fetch.allow_networks: {cidr!r} is not a CIDR network") from None
    _check_dns_servers(cfg.fetch.dns_servers)
    _check_importable(cfg.pipeline.middleware, "pipeline.middleware")
    _check_hooks(cfg.pipeline.hooks)
    _check_patterns(cfg.scope.allow, "scope.allow")
    _check_patterns(cfg.scope.deny, "scope.deny")


def _check_hooks(specs: tuple[str, ...]) -> None:
    """Hooks are imported at config load too: `check-config` and `run` exit 2 on a bad one."""
    if not specs:
        return
    from crawld.pipeline.hooks import load_hooks   # lazy: it imports this module
    load_hooks(specs)


def _check_patterns(patterns: tuple[str, ...], key: str) -> None:
    import re
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"{key}: {pattern!r} is not a valid regex ({exc})") from None


def _check_importable(specs: tuple[str, ...], key: str) -> None:
    """Resolve user code at config load, so `crawld run` and `check-config` exit 2
    on a bad entry instead of every forked worker failing at boot."""
    if not specs:
        return
    from crawld.pipeline.middleware import import_factory   # lazy: it imports this module
    for spec in specs:
        import_factory(spec, key)


def _check_dns_servers(entries: tuple[str, ...]) -> None:
    if not entries:
        return
    from crawld.fetch.resolver import parse_nameserver   # lazy: crawld.fetch imports this module
    for entry in entries:
        try:
            parse_nameserver(entry)
        except ValueError as exc:
            raise ConfigError(f"fetch.dns_servers: {exc}") from None


def _url_scheme_fits(broker: BrokerConfig) -> bool:
    scheme = urlsplit(broker.url.split(",")[0]).scheme
    if broker.transport == "amqp":
        return scheme in ("amqp", "amqps")
    return scheme in ("nats", "tls", "ws", "wss")


def redact_url(url: str) -> str:
    """The URL with any password replaced, for logs and status output."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def env_for(cfg: Config) -> dict[str, str]:
    """Env overrides that reproduce ``cfg`` in a child process started with the same file."""
    out: dict[str, str] = {}
    for name in SECTIONS:
        section = getattr(cfg, name)
        for f in fields(section):
            value = getattr(section, f.name)
            var = f"{ENV_PREFIX}{name.upper()}_{f.name.upper()}"
            out[var] = json.dumps(list(value)) if isinstance(value, tuple) else (
                ("true" if value else "false") if isinstance(value, bool) else str(value))
    return out


def sqlite_path(store_url: str) -> Path:
    """``sqlite:///var/lib/x.db`` and ``sqlite:////var/lib/x.db`` both mean /var/lib/x.db."""
    return Path("/" + store_url[len("sqlite://"):].lstrip("/"))


def warc_directory(store: StoreConfig) -> str:
    """``store.warc_dir``, or ``warc`` beside ``body_dir`` when empty: one setting
    (body_dir) keeps every output of a test or a demo inside its own directory."""
    if store.warc_dir:
        return store.warc_dir
    return os.path.join(os.path.dirname(store.body_dir.rstrip("/")) or ".", "warc")


def runtime_dir(cfg: Config) -> Path:
    """State file and politeness locks; must be ours, since other users could forge them."""
    base = cfg.workers.run_dir or os.path.join(tempfile.gettempdir(), f"crawld-{os.getuid()}")
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_uid != os.getuid():
        raise ConfigError(f"workers.run_dir: {path} belongs to another user")
    return path
