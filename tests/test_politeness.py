"""Politeness: host-wide concurrency (threads and processes), spacing, Crawl-delay, back-off."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from crawld.fetch import politeness
from crawld.config import FetchConfig
from crawld.fetch import Fetcher
from crawld.fetch.politeness import HostLimiter, PolitenessTimeout

try:
    from fetch_servers import LocalServer, forbid_external_network, page, robots, sequence, slow
except ImportError:  # tests/ imported as a package
    from tests.fetch_servers import LocalServer, forbid_external_network, page, robots, sequence, slow


@pytest.fixture(autouse=True)
def net(monkeypatch):
    return forbid_external_network(monkeypatch)


@pytest.fixture
def make(tmp_path):
    made: list[Fetcher] = []

    def build(politeness_wait_s: float | None = None, **overrides) -> Fetcher:
        cfg = FetchConfig(**{"allow_networks": ("127.0.0.0/8",), "obey_robots": False,
                             "timeout_s": 5.0, **overrides})
        made.append(Fetcher(cfg, pool_size=8, run_dir=str(tmp_path), politeness_wait_s=politeness_wait_s))
        return made[-1]
    yield build
    for f in made:
        f.close()


def gaps(times: list[float]) -> list[float]:
    times = sorted(times)
    return [round(b - a, 3) for a, b in zip(times, times[1:])]


# ----------------------------------------------------------------------------- concurrency
def test_per_host_limit_holds_under_8_threads(make) -> None:
    with LocalServer({"*": slow(0.1)}) as srv:
        f = make(per_host_concurrency=2)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(f.fetch, [srv.url(f"/p{i}") for i in range(24)]))
        print(f"\n8 threads, per_host_concurrency=2: server saw max {srv.max_active} concurrent")
        assert srv.max_active == 2
    assert all(r.kind == "response" for r in results)


CHILD = textwrap.dedent("""
    import json, os, sys, time
    from concurrent.futures import ThreadPoolExecutor
    from crawld.config import FetchConfig
    from crawld.fetch import Fetcher
    url, run_dir, go_file, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    f = Fetcher(FetchConfig(allow_networks=("127.0.0.0/8",), obey_robots=False, timeout_s=10,
                            per_host_concurrency=2), pool_size=4, run_dir=run_dir, politeness_wait_s=20)
    print("ready", flush=True)
    while not os.path.exists(go_file):     # a barrier: both children start together, however slow to boot
        time.sleep(0.005)
    with ThreadPoolExecutor(4) as pool:
        print(json.dumps([r.kind for r in pool.map(f.fetch, [url] * n)]))
""")


@pytest.mark.parametrize("shared", [True, False], ids=["shared-run-dir", "control-separate-run-dirs"])
def test_limit_is_host_wide_across_worker_processes(tmp_path, shared: bool) -> None:
    """Two worker processes x 4 threads; the control shows the test would see a per-process limit."""
    run_dirs = [tmp_path / "run"] * 2 if shared else [tmp_path / "a", tmp_path / "b"]
    with LocalServer({"*": slow(0.1)}) as srv:
        go = tmp_path / "go"
        children = [subprocess.Popen([sys.executable, "-c", CHILD, srv.url("/"), str(run_dir),
                                      str(go), "8"], stdout=subprocess.PIPE, text=True)
                    for run_dir in run_dirs]
        assert [c.stdout.readline().strip() for c in children] == ["ready", "ready"]
        go.touch()                            # both children start hitting the host together
        outputs = [json.loads(c.communicate(timeout=60)[0]) for c in children]
        print(f"\n2 processes x 4 threads, {'shared' if shared else 'separate'} run_dir, "
              f"per_host_concurrency=2: server saw max {srv.max_active} concurrent")
        if shared:
            assert srv.max_active == 2         # not 2 per process
        else:
            assert srv.max_active > 2
    assert [kinds.count("response") for kinds in outputs] == [8, 8]


def test_bounded_wait_returns_politeness_error(make) -> None:
    with LocalServer({"*": slow(1.0)}) as srv:
        f = make(per_host_concurrency=1, politeness_wait_s=0.2)
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(f.fetch, [srv.url("/a"), srv.url("/b")]))
    kinds = sorted((r.kind, r.reason) for r in results)
    assert kinds == [("error", "politeness"), ("response", "")]
    assert f.stats.get("politeness/timeout") == 1


def test_slot_of_a_killed_process_is_released(tmp_path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from crawld.fetch.politeness import HostLimiter
        slot = HostLimiter({str(tmp_path)!r}, 1).acquire("example.test", wait_s=1)
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        limiter = HostLimiter(str(tmp_path), 1)
        with pytest.raises(PolitenessTimeout):
            limiter.acquire("example.test", wait_s=0.1)
    finally:
        holder.kill()
        holder.wait()
    limiter.acquire("example.test", wait_s=2).release()      # the kernel dropped the dead lock


def test_slot_files_stay_open_between_requests(tmp_path, monkeypatch) -> None:
    """One open per slot file, however many requests: each takes and drops its slot with a
    flock; an open (and a close) per request was a path lookup and two GIL hand-backs more."""
    limiter = HostLimiter(str(tmp_path), 2)
    real_open, opened = os.open, []
    monkeypatch.setattr(politeness.os, "open", lambda path, *a: opened.append(path) or real_open(path, *a))
    for _ in range(20):
        limiter.acquire("example.test", wait_s=1).release()
    slot_files = [path for path in opened if ".slot" in path]
    assert len(slot_files) == 1, slot_files
    limiter.close()
    assert HostLimiter(str(tmp_path), 1).acquire("example.test", wait_s=0.5)   # closed: free


def test_a_forked_child_never_shares_its_parents_slot(tmp_path) -> None:
    """A child forked with the limiter's open slot files shares their flocks; it must open
    its own, or it would take the slot its parent holds (concurrency 1: two requests)."""
    limiter = HostLimiter(str(tmp_path), 1)
    limiter.acquire("example.test", wait_s=1).release()      # slot file left open, idle
    held, go = os.pipe()
    pid = os.fork()
    if pid == 0:                                              # the child
        os.read(held, 1)                                      # the parent holds the slot now
        try:
            limiter.acquire("example.test", wait_s=0.3)
            code = 1                                          # took the parent's slot
        except PolitenessTimeout:
            code = 0
        os._exit(code)
    slot = limiter.acquire("example.test", wait_s=1)
    os.write(go, b"x")
    _, status = os.waitpid(pid, 0)
    slot.release()
    assert os.waitstatus_to_exitcode(status) == 0, "the child took the slot its parent holds"


# ----------------------------------------------------------------------------- spacing
def test_crawl_delay_spacing_measured(make) -> None:
    with LocalServer({"/robots.txt": robots("User-agent: *\nCrawl-delay: 0.25\n"), "*": page()}) as srv:
        f = make(obey_robots=True, per_host_concurrency=2)
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(f.fetch, [srv.url(f"/p{i}") for i in range(5)]))
        measured = gaps(srv.times("/p"))
        print(f"\nCrawl-delay 0.25 s, 4 threads: gaps between page requests {measured}")
    assert all(r.kind == "response" for r in results)
    assert len(measured) == 4 and min(measured) >= 0.225     # 0.25 minus scheduler jitter


def test_per_host_delay_is_randomised_like_scrapy(make, monkeypatch) -> None:
    factors: list[tuple[float, float]] = []
    real_uniform = politeness.random.uniform

    def spy(a: float, b: float) -> float:
        factors.append((a, b))
        return real_uniform(a, b)
    monkeypatch.setattr(politeness.random, "uniform", spy)
    with LocalServer({"*": page()}) as srv:
        f = make(per_host_delay_s=0.1)
        for i in range(5):
            f.fetch(srv.url(f"/p{i}"))
        measured = gaps(srv.times("/p"))
    print(f"\nper_host_delay_s 0.1 (x0.5-1.5): gaps {measured}")
    assert (0.5, 1.5) in factors
    assert min(measured) >= 0.04                                 # 0.1 x 0.5, minus jitter


def test_retry_after_honoured_before_next_request(make) -> None:
    routes = {"/busy": sequence(page(b"", 503, {"Retry-After": "1"}), page(b"fine"))}
    with LocalServer(routes) as srv:
        f = make(politeness_wait_s=5)
        first = f.fetch(srv.url("/busy"))
        second = f.fetch(srv.url("/busy"))
        measured = gaps(srv.times("/busy"))
    print(f"\n503 Retry-After: 1 -> next request {measured[0]} s later")
    assert (first.http_status, first.retry_after_s) == (503, 1.0)
    assert (second.http_status, second.body) == (200, b"fine")
    assert measured[0] >= 0.99


def test_with_no_gap_a_start_is_read_without_a_syscall_and_sees_other_processes(tmp_path, monkeypatch) -> None:
    """per_host_delay_s 0 and no Crawl-delay: a request reads the host's record through its
    mapping, no open and no lock of the state file; a Retry-After another process records
    there still stops the next request (it takes the locked path and waits, or gives up)."""
    limiter = HostLimiter(str(tmp_path), 4)
    limiter.acquire("example.test", wait_s=1).release()        # the record exists now
    real_open, opened = os.open, []
    monkeypatch.setattr(politeness.os, "open", lambda path, *a: opened.append(path) or real_open(path, *a))
    for _ in range(20):
        limiter.acquire("example.test", wait_s=1).release()
    assert len([path for path in opened if path.endswith(".state")]) == 1    # to map it, once
    pid = os.fork()
    if pid == 0:                                                # another worker gets a 503
        HostLimiter(str(tmp_path), 4).backoff("example.test", retry_after_s=30.0)
        os._exit(0)
    os.waitpid(pid, 0)
    with pytest.raises(PolitenessTimeout) as info:
        limiter.acquire("example.test", wait_s=0.5)
    assert 25.0 < info.value.retry_in_s <= 30.0
    assert len([path for path in opened if path.endswith(".state")]) == 2    # the locked path


def test_backoff_doubles_and_expires(tmp_path, monkeypatch) -> None:
    limiter = HostLimiter(str(tmp_path), 1)
    before = time.time()
    assert [limiter.backoff("a.test") for _ in range(4)] == [1.0, 2.0, 4.0, 8.0]
    with pytest.raises(PolitenessTimeout) as info:
        limiter.acquire("a.test", wait_s=0.0)
    # the 8 s gap from the last back-off, minus however long this machine took to get here
    assert 8.0 - (time.time() - before) <= info.value.retry_in_s <= 8.0
    assert limiter.acquire("b.test", wait_s=0.0)             # other hosts are unaffected
    later = time.time() + politeness.BACKOFF_WINDOW_S + 10
    monkeypatch.setattr(politeness.time, "time", lambda: later)
    assert limiter.backoff("a.test") == 1.0                   # window over: starts again


def test_state_lives_in_run_dir_hosts(tmp_path, monkeypatch) -> None:
    HostLimiter(str(tmp_path), 2).acquire("Example.TEST", wait_s=1).release()
    names = sorted(os.listdir(tmp_path / "hosts"))
    bucket = HostLimiter(str(tmp_path), 2).bucket("example.test")
    # one of the two slots (a process starts looking at a slot of its own) and the state
    assert names in ([f"{bucket}.slot0", f"{bucket}.state"], [f"{bucket}.slot1", f"{bucket}.state"])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")
    assert HostLimiter("", 1).dir == os.path.join(str(tmp_path / "tmp"), f"crawld-{os.getuid()}", "hosts")


def test_slots_are_exclusive_between_threads(tmp_path) -> None:
    limiter = HostLimiter(str(tmp_path), 3)
    active, peak, lock = [0], [0], threading.Lock()

    def work() -> None:
        with limiter.acquire("h.test", wait_s=10):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(0.01)
            with lock:
                active[0] -= 1
    with ThreadPoolExecutor(12) as pool:
        for _ in pool.map(lambda _: work(), range(60)):
            pass
    assert peak[0] == 3
