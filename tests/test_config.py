"""Config: TOML + env overrides, validation naming the key, the example file, exit codes."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from crawld.config import SECTIONS, Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([sys.executable, "-m", "crawld", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60)


def test_defaults_without_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, env={})
    assert cfg == Config()


def test_env_overrides_every_type(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[workers]\ncount = 3\n[queue]\nretry_delays_s = [1, 2]\n')
    env = {"CRAWLD_WORKERS_COUNT": "5", "CRAWLD_FETCH_OBEY_ROBOTS": "false",
           "CRAWLD_QUEUE_RETRY_DELAYS_S": "[2, 4, 8]", "CRAWLD_FETCH_ALLOW_NETWORKS": "10.0.0.0/8,127.0.0.0/8",
           "CRAWLD_BROKER_URL": "amqp://u:p@127.0.0.1:5673/%2F", "CRAWLD_FETCH_TIMEOUT_S": "2.5"}
    cfg = load_config(str(path), env=env)
    assert cfg.workers.count == 5
    assert cfg.fetch.obey_robots is False
    assert cfg.queue.retry_delays_s == (2.0, 4.0, 8.0)
    assert cfg.fetch.allow_networks == ("10.0.0.0/8", "127.0.0.0/8")
    assert cfg.broker.url.endswith(":5673/%2F")
    assert cfg.fetch.timeout_s == 2.5


@pytest.mark.parametrize("text, env, key", [
    ("[workers]\ncount = 'many'\n", {}, "workers.count"),
    ("[workers]\ncuont = 2\n", {}, "workers.cuont"),
    ("[broker]\ntransport = 'kafka'\n", {}, "broker.transport"),
    ("[queue]\nretry_delays_s = [60, 5]\n", {}, "queue.retry_delays_s"),
    ("[fetch]\nallow_networks = ['not-a-net']\n", {}, "fetch.allow_networks"),
    ("[broker]\ntransport = 'jetstream'\n", {}, "broker.url"),
    ("", {"CRAWLD_QUEUE_PREFETCH": "lots"}, "queue.prefetch"),
    ("[nope]\nx = 1\n", {}, "[nope]"),
    ("[workers\n", {}, "invalid TOML"),
    ("[fetch]\nbreaker_ratio = 1.5\n", {}, "fetch.breaker_ratio"),
    ("[fetch]\nbreaker_min_sites = 1\n", {}, "fetch.breaker_min_sites"),
    ("", {"CRAWLD_STORE_LOCK_WAIT_S": "0"}, "store.lock_wait_s"),
    ("[workers]\nprobe_max_s = -1\n", {}, "workers.probe_max_s"),
])
def test_bad_config_names_the_key(tmp_path, text, env, key):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path), env=env)
    assert key in str(err.value)
    done = run_cli("check-config", "-c", str(path), env=env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in done.stderr


def test_usage_errors_exit_2():
    assert run_cli("frobnicate").returncode == 2
    assert run_cli("status", "-c", "/nonexistent/crawld.toml").returncode == 2
    done = run_cli("run", "--workers", "-1", "-c", str(ROOT / "etc/crawld.toml"))
    assert done.returncode == 2 and "workers" in done.stderr


def test_example_config_documents_every_key_with_its_default():
    example = tomllib.loads((ROOT / "etc/crawld.toml").read_text())
    assert set(example) == set(SECTIONS)
    for name, cls in SECTIONS.items():
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        assert set(example[name]) == set(defaults), name
        for key, value in example[name].items():
            default = defaults[key]
            got = tuple(value) if isinstance(default, tuple) else value
            assert got == default, f"{name}.{key}: example {value!r} != default {default!r}"
    load_config(str(ROOT / "etc/crawld.toml"), env={})


def test_readme_documents_every_key():
    readme = (ROOT / "README.md").read_text()
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert re.search(rf"`{name}\.{f.name}`", readme), f"README lacks {name}.{f.name}"


def test_check_config_redacts_password(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[broker]\nurl = "amqp://crawler:s3cret@127.0.0.1:5672/%2F"\n')
    done = run_cli("check-config", "-c", str(path))
    assert done.returncode == 0
    assert "s3cret" not in done.stdout and "crawler:***@" in done.stdout
