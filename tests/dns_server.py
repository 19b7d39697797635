"""A real DNS server for tests: Debian's dnsmasq (package ``dnsmasq-base``) on 127.0.0.1.

Private config only: ``--no-resolv`` (no upstream: nothing is forwarded off the machine),
``--no-hosts`` (not the machine's /etc/hosts), ``local=/test/`` (answered here only: a
name with just an A record gets a real NODATA for AAAA, an unknown one NXDOMAIN, as
from an authoritative server), a hosts file of our own that
:meth:`LocalDNS.set` rewrites and reloads with SIGHUP, ``address=/name/`` entries for
names that must get NXDOMAIN, queries logged to a file so tests can count what the
resolver really asked. Binds 127.0.0.1 only, UDP and TCP on one free port.
"""
from __future__ import annotations

import grp
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import time
from typing import Iterable

import dns.exception
import dns.message
import dns.query
import dns.rcode

DNSMASQ = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"


def dnsmasq_available() -> bool:
    return os.access(DNSMASQ, os.X_OK)


class LocalDNS:
    """``with LocalDNS(dir, {"evil.test": ["10.0.0.1"]}) as dns: ... dns.server ...``"""

    def __init__(self, directory: str, records: dict[str, list[str]], *, ttl_s: int = 3600,
                 nxdomain: Iterable[str] = (), local_domains: Iterable[str] = ("test",)) -> None:
        self.dir = directory
        self.ttl_s = ttl_s
        self.nxdomain = tuple(nxdomain)
        self.local_domains = tuple(local_domains)
        self.records = dict(records)
        self.hosts_path = os.path.join(directory, "hosts")
        self.log_path = os.path.join(directory, "dnsmasq.log")
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def server(self) -> str:
        """The ``fetch.dns_servers`` entry for this server."""
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> "LocalDNS":
        os.makedirs(self.dir, exist_ok=True)
        self._write_hosts()
        for _ in range(5):          # a free port can be taken between probe and bind
            self.port = _free_udp_tcp_port()
            if self._start():
                return self
        raise RuntimeError(f"dnsmasq did not start: {self._log_tail()}")

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    # -- records -----------------------------------------------------------------------
    def set(self, name: str, addresses: list[str]) -> None:
        """Change ``name``'s answer; returns once dnsmasq has re-read its hosts file."""
        self.records[name] = list(addresses)
        before = self._log().count(f"read {self.hosts_path}")
        self._write_hosts()
        assert self._proc is not None
        self._proc.send_signal(signal.SIGHUP)
        _wait_for(lambda: self._log().count(f"read {self.hosts_path}") > before, 10.0,
                  "dnsmasq to reload its hosts file")

    def queries(self, name: str, qtype: str = "A") -> int:
        """How many ``qtype`` queries for ``name`` the server has received so far."""
        pattern = re.compile(rf"query\[{re.escape(qtype)}\] {re.escape(name)} from ")
        return len(pattern.findall(self._log()))

    def wait_queries(self, name: str, at_least: int, qtype: str = "A") -> int:
        """The query count once it reaches ``at_least`` (the log is written asynchronously)."""
        try:
            _wait_for(lambda: self.queries(name, qtype) >= at_least, 5.0, "the query log")
        except TimeoutError:
            pass
        return self.queries(name, qtype)

    # -- process -----------------------------------------------------------------------
    def _start(self) -> bool:
        conf = os.path.join(self.dir, "dnsmasq.conf")
        with open(conf, "w") as fh:
            fh.write("\n".join(self._options()) + "\n")
        self._proc = subprocess.Popen([DNSMASQ, f"--conf-file={conf}"], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_for(self._answers, 10.0, "dnsmasq to answer")
            return True
        except TimeoutError:
            self.__exit__()
            return False

    def _options(self) -> list[str]:
        user = pwd.getpwuid(os.geteuid()).pw_name
        group = grp.getgrgid(os.getegid()).gr_name
        options = ["keep-in-foreground", "no-resolv", "no-hosts", "no-poll", "bind-interfaces",
                   "listen-address=127.0.0.1", f"port={self.port}", f"user={user}", f"group={group}",
                   f"pid-file={os.path.join(self.dir, 'dnsmasq.pid')}", f"addn-hosts={self.hosts_path}",
                   f"local-ttl={self.ttl_s}", "cache-size=0", "log-queries",
                   f"log-facility={self.log_path}"]
        return (options + [f"local=/{domain}/" for domain in self.local_domains]
                + [f"address=/{name}/" for name in self.nxdomain])

    def _answers(self) -> bool:
        if self._proc is None or self._proc.poll() is not None:
            raise TimeoutError("dnsmasq exited")
        query = dns.message.make_query("nx.probe.invalid", "A")
        try:
            reply = dns.query.udp(query, "127.0.0.1", timeout=0.5, port=self.port)
        except (OSError, dns.exception.DNSException):
            return False
        return reply.rcode() in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN, dns.rcode.REFUSED)

    def _write_hosts(self) -> None:
        lines = [f"{address} {name}" for name, addresses in self.records.items() for address in addresses]
        tmp = self.hosts_path + ".tmp"
        with open(tmp, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        os.replace(tmp, self.hosts_path)

    def _log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except FileNotFoundError:
            return ""

    def _log_tail(self) -> str:
        return self._log()[-2000:]


def _free_udp_tcp_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = udp.getsockname()[1]
            with socket.socket() as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
        return port


def _wait_for(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    give_up = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > give_up:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def start_or_skip(directory: str, records: dict[str, list[str]], **kw: object) -> LocalDNS:
    """A started LocalDNS (the caller exits it), or a pytest skip naming the missing package."""
    import pytest
    if not dnsmasq_available():
        pytest.skip("dnsmasq not installed (apt-get install dnsmasq-base)")
    return LocalDNS(directory, records, **kw).__enter__()  # type: ignore[arg-type]


# Names the shared test server answers. Private and public addresses here are only ever
# *classified* by the guard; tests that really connect use 127.0.0.x names.
RECORDS = {
    "evil.test": ["10.0.0.1"], "rfc1918b.test": ["172.16.5.4"], "home.test": ["192.168.1.1"],
    "meta.test": ["169.254.169.254"], "v6.test": ["::1"], "mapped.test": ["::ffff:192.168.0.1"],
    "public.test": ["93.184.216.34"], "mixed.test": ["10.0.0.1", "93.184.216.34"],
    "a.test": ["93.184.216.34"], "long.test": ["93.184.216.34"],
    "crawl.test": ["127.0.0.1"], "rebind.test": ["127.0.0.1"], "loop.test": ["127.0.0.2"],
}
