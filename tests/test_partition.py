"""Pure logic of the fleet: partition keys, the stable shard hash, the in-process site
limiter and the AMQP shard bookkeeping (no broker needed: nothing here talks to one)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from crawld.config import load_config
from crawld.fetch.politeness import PolitenessTimeout
from crawld.fetch.sites import FAILURE_RUN, SiteLimiter
from crawld.fleet.partition import partition_key, registrable_domain, shard_label, shard_of, shard_pull_cap, shard_window
from crawld.transports.amqp.shards import ACTIVE_WINDOW_S, SETTLE_S, STEP_BACK_EVERY_S, Shards
from crawld.transports.base import Delivery


def test_partition_key_is_the_host_without_port_or_the_registrable_domain():
    assert partition_key("http://WWW.Example.CO.UK:8080/a?b", "host") == "www.example.co.uk"
    assert partition_key("https://www.example.co.uk./x", "host") == "www.example.co.uk"
    assert partition_key("http://a.b.example.co.uk/", "domain") == "example.co.uk"
    assert partition_key("http://blog.github.io/", "domain") == "blog.github.io"   # private suffix
    assert registrable_domain("127.0.0.1") == "127.0.0.1"
    assert shard_of("http://x.example.com/", "none", 64) is None


def test_shard_is_stable_across_processes_and_python_hash_seeds():
    """blake2b, not hash(): the same shard in every process, host and version."""
    urls = ["http://example.com/a", "https://www.example.org:8443/b", "http://127.0.0.7:1/"]
    here = [shard_of(u, "host", 64) for u in urls]
    code = ("from crawld.fleet.partition import shard_of; "
            f"print([shard_of(u, 'host', 64) for u in {urls!r}])")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}, check=True)
        assert out.stdout.strip() == str(here)
    # Pinned: a change of the hash would remap every site of a running fleet.
    assert here == [38, 52, 27]
    assert shard_of("http://a.example.com/", "domain", 64) == shard_of("http://b.example.com/", "domain", 64)
    assert shard_label(7, 64) == "07" and shard_label(7, 512) == "007" and shard_label(0, 1) == "0"


def test_partition_config_is_validated_with_the_key_named(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[queue]\npartition = "ip"\n')
    with pytest.raises(ValueError, match="queue.partition"):
        load_config(str(bad), env={})
    bad.write_text("[queue]\nshards = 0\n")
    with pytest.raises(ValueError, match="queue.shards"):
        load_config(str(bad), env={})
    assert load_config(None, env={}).queue.partition == "host"     # the default: a polite fleet


def test_site_limiter_pause_after_429_with_retry_after_and_after_a_failure_run():
    limiter = SiteLimiter(1, 0.0)
    assert limiter.paused_for("a.test") == 0.0
    limiter.backoff("a.test", retry_after_s=3.0)
    assert 2.9 < limiter.paused_for("a.test") <= 3.0
    assert limiter.paused_for("b.test") == 0.0, "one site's pause is not another's"
    for _ in range(FAILURE_RUN - 1):
        assert limiter.record("c.test", unreachable=True) == 0.0
    assert limiter.record("c.test", unreachable=False) == 0.0, "an answer ends the run"
    for _ in range(FAILURE_RUN - 1):
        assert limiter.record("c.test", unreachable=True) == 0.0
    pauses = [limiter.record("c.test", unreachable=True) for _ in range(8)]
    # A run pauses the site; after that each failure (one probe per pause) doubles it, capped.
    assert pauses == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0], pauses
    assert set(limiter.paused_sites()) == {"a.test", "c.test"}


def _pause_over(limiter: SiteLimiter, host: str) -> None:
    """As if the pause (and the spacing the back-off adds) had run out."""
    site = limiter._sites[host]
    site.not_before = site.last_start = 0.0


def test_an_unreachable_site_is_half_open_after_its_pause_one_request_tests_it():
    limiter = SiteLimiter(8, 0.0, max_waiting=8)
    for _ in range(FAILURE_RUN):
        limiter.record("down.test", unreachable=True)
    assert limiter.unreachable("down.test") and limiter.paused_for("down.test") > 0
    assert not limiter.unreachable("up.test")
    _pause_over(limiter, "down.test")
    probe = limiter.acquire("down.test", wait_s=1.0)
    with pytest.raises(PolitenessTimeout) as waits:         # not a burst of all 8 slots
        limiter.acquire("down.test", wait_s=1.0)
    assert waits.value.retry_in_s >= 0.5
    limiter.record("down.test", unreachable=True)           # the test failed: paused again
    probe.release()
    assert limiter.paused_for("down.test") > 1.5 and limiter.unreachable("down.test")
    _pause_over(limiter, "down.test")
    probe = limiter.acquire("down.test", wait_s=1.0)
    limiter.record("down.test", unreachable=False)          # it answered: closed again
    probe.release()
    slots = []
    for _ in range(3):      # several at once again (the back-off still widens the spacing)
        _pause_over(limiter, "down.test")
        slots.append(limiter.acquire("down.test", wait_s=1.0))
    assert not limiter.unreachable("down.test")
    for slot in slots:
        slot.release()
    limiter.backoff("busy.test", retry_after_s=1.0)         # a 429 is an answer: no half-open
    busy = []
    for _ in range(2):
        _pause_over(limiter, "busy.test")
        busy.append(limiter.acquire("busy.test", wait_s=1.0))
    assert not limiter.unreachable("busy.test")
    for slot in busy:
        slot.release()


def test_site_limiter_one_at_a_time_spaced_and_no_head_of_line_blocking():
    limiter = SiteLimiter(1, 0.05, max_waiting=1)
    starts: list[tuple[float, float]] = []      # (reserved start, when the thread began)
    lock = threading.Lock()

    def fetch() -> None:
        with limiter.acquire("a.test", wait_s=5.0) as slot:
            with lock:
                starts.append((slot.start, time.monotonic()))
            time.sleep(0.01)

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.01)
    # One thread holds a.test, one waits for it: a third is refused at once (it goes back
    # to the broker instead of parking a thread), and other sites are not held up.
    with pytest.raises(PolitenessTimeout) as refused:
        limiter.acquire("a.test", wait_s=5.0)
    assert refused.value.retry_in_s is not None and refused.value.retry_in_s > 0
    with limiter.acquire("b.test", wait_s=0.5):
        pass
    for t in threads:
        t.join()
    # The spacing is between reserved starts; each thread slept until its own. (Comparing
    # when the threads began also counts how late the OS woke the first one: CI, stop 35.)
    assert len(starts) == 2 and starts[1][0] - starts[0][0] >= 0.6 * 0.05
    assert all(began >= reserved for reserved, began in starts)


def test_threads_waiting_for_a_site_give_their_tasks_back_when_it_is_paused():
    """A thread parked behind a.test's one slot must not sleep out a Retry-After: the
    pause hands its task back (with the pause as the delay) at once."""
    limiter = SiteLimiter(1, 0.0, max_waiting=2)
    held = limiter.acquire("a.test", wait_s=1.0)
    outcome: list[BaseException | None] = []

    def waiter() -> None:
        try:
            limiter.acquire("a.test", wait_s=10.0).release()
            outcome.append(None)
        except PolitenessTimeout as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.05)
    paused_at = time.monotonic()
    limiter.backoff("a.test", retry_after_s=3.0)
    thread.join(2.0)
    assert not thread.is_alive() and time.monotonic() - paused_at < 1.0
    assert isinstance(outcome[0], PolitenessTimeout) and 2.5 < outcome[0].retry_in_s <= 3.0
    held.release()


def test_a_shard_that_comes_back_waits_one_delay_before_its_sites():
    limiter = SiteLimiter(1, 0.3, shard_of=lambda host: 5 if host == "a.test" else 6)
    with limiter.acquire("a.test", wait_s=1.0):
        pass
    time.sleep(0.45)     # longer than the largest randomised gap (1.4 x 0.3)
    started = time.monotonic()
    with limiter.acquire("a.test", wait_s=1.0):
        pass
    assert time.monotonic() - started < 0.05, "no wait: the delay has passed"
    time.sleep(0.45)
    limiter.shard_acquired(5)
    started = time.monotonic()
    with limiter.acquire("a.test", wait_s=1.0):
        pass
    assert time.monotonic() - started >= 0.6 * 0.3, "another owner may have just served it"


def _delivery(queue: str) -> Delivery:
    return Delivery(body=b"{}", message_id="t", attempt=1, redelivered=False, origin=queue, handle=None)


def test_shards_release_the_surplus_of_busy_shards_least_recent_first():
    cfg = load_config(None, env={}).replace("queue", shards=8)
    now = [100.0]
    shards = Shards(cfg, clock=lambda: now[0])
    acquired: list[int] = []
    for i in range(6):                      # this worker owns six busy shards
        now[0] += 0.1
        assert not shards.hold(shards.queues[i], _delivery(shards.queues[i]), acquired.append)
    assert acquired == list(range(6))
    assert shards.start_releases(consumers=1, waiting=set()) == []
    released = shards.start_releases(consumers=3, waiting=set())   # fair: ceil(6 / 3) = 2
    assert released == shards.queues[:4], "the least recently active go first"
    assert shards.active() == [4, 5]
    held = _delivery(shards.queues[0])
    assert shards.hold(shards.queues[0], held, acquired.append), "held while handed over"
    assert shards.ready_to_release({shards.queues[0]: 1}) == [], "idle for SETTLE_S first"
    now[0] += SETTLE_S
    assert shards.ready_to_release({shards.queues[0]: 1}) == shards.queues[1:4]
    assert shards.finish_release(shards.queues[0]) == [held]
    now[0] += ACTIVE_WINDOW_S + 1
    assert shards.active() == [], "shards that stopped delivering are not counted as ours"


def test_a_shard_whose_queue_emptied_into_its_owners_window_still_counts_as_busy():
    """The other worker's shards stop showing messages ready once their queues sit in its
    prefetch windows; it still has their tasks to run, so this worker's share stays the same
    and nothing is handed over (a handover stalls the shard's sites meanwhile)."""
    cfg = load_config(None, env={}).replace("queue", shards=8)
    now = [100.0]
    shards = Shards(cfg, clock=lambda: now[0])
    q = shards.queues

    def deliver_own() -> None:
        for queue in q[:4]:
            shards.hold(queue, _delivery(queue), lambda shard: None)

    deliver_own()
    assert shards.start_releases(consumers=2, waiting=set(q)) == [], "8 busy / 2: a share of 4"
    now[0] += ACTIVE_WINDOW_S / 2
    deliver_own()
    assert shards.start_releases(consumers=2, waiting=set()) == [], "the others' shards emptied lately"
    assert shards.step_backs(consumers=2, waiting=set()) == []
    now[0] += ACTIVE_WINDOW_S / 2
    deliver_own()
    assert shards.start_releases(consumers=2, waiting=set()) == q[:2], \
        "no sign of work elsewhere for ACTIVE_WINDOW_S: 4 busy / 2 workers, two go"


def test_a_worker_at_its_share_steps_back_from_busy_shards_it_does_not_own():
    cfg = load_config(None, env={}).replace("queue", shards=8)
    now = [100.0]
    shards = Shards(cfg, clock=lambda: now[0])
    q = shards.queues
    for queue in q[:2]:                          # owns two busy shards
        shards.hold(queue, _delivery(queue), lambda shard: None)
    others = {q[2], q[3], q[4], q[5]}            # four more busy shards, served elsewhere
    # 6 busy / 4 workers: fair share 2, held: step back (re-queue) on the other four
    assert shards.step_backs(consumers=4, waiting=others) == sorted(others)
    assert shards.step_backs(consumers=4, waiting=others) == [], "once per STEP_BACK_EVERY_S"
    # a fifth worker joins (a host restarted): make way for it now, not after the timer
    assert shards.step_backs(consumers=5, waiting=others) == sorted(others)
    assert shards.step_backs(consumers=5, waiting=others) == []
    now[0] += STEP_BACK_EVERY_S
    for queue in q[:2]:                          # still delivering here
        shards.hold(queue, _delivery(queue), lambda shard: None)
    assert shards.step_backs(consumers=4, waiting=others) == sorted(others)
    # 6 busy / 2 workers: fair share 3, this worker has 2: it wants the next one in line
    now[0] += STEP_BACK_EVERY_S
    for queue in q[:2]:
        shards.hold(queue, _delivery(queue), lambda shard: None)
    assert shards.step_backs(consumers=2, waiting=others) == []
    assert shards.step_backs(consumers=1, waiting=others) == []


@pytest.mark.parametrize("prefetch, threads, workers, per_host, expected", [
    (16, 16, 2, 2, 4),        # the defaults: 2 x per_host_concurrency, as before
    (256, 256, 2, 2, 32),     # 32 shards each: 4 x 256 / 32, not 4 (half the threads idle)
    (256, 256, 1, 2, 16),
    (8, 256, 2, 2, 4),        # the worker's prefetch bounds its hand
    (2, 16, 2, 8, 2),         # never above queue.prefetch
    (16, 16, 0, 1, 2),        # scaled to zero workers: still a valid window
])
def test_shard_window_fills_the_threads_of_a_fair_share(prefetch: int, threads: int, workers: int,
                                                        per_host: int, expected: int) -> None:
    from crawld.config import Config, FetchConfig, QueueConfig, WorkersConfig
    cfg = Config(queue=QueueConfig(prefetch=prefetch, shards=64), fetch=FetchConfig(per_host_concurrency=per_host),
                 workers=WorkersConfig(threads=threads, count=workers))
    assert shard_window(cfg) == expected


def test_shard_pull_cap_only_where_spreading_a_large_hand_sets_the_window() -> None:
    from crawld.config import Config, QueueConfig, WorkersConfig
    wide = Config(queue=QueueConfig(prefetch=256), workers=WorkersConfig(threads=256, count=2))
    small = Config(queue=QueueConfig(prefetch=8), workers=WorkersConfig(threads=8, count=2))
    assert shard_pull_cap(wide) == shard_window(wide) == 32
    assert shard_pull_cap(small) is None and shard_window(small) == 4    # 2 x per_host_concurrency
    assert shard_pull_cap(Config()) is None


def test_site_of_fast_path_agrees_with_urlsplit():
    """site_of reads plain hosts off a pattern: every shape here (and thousands of random
    ones) gets the key urlsplit gives, so no site changes shard."""
    import random
    from urllib.parse import urlsplit

    from crawld.fleet.partition import _PLAIN_HOST, site_of

    def reference(url: str) -> str:
        try:
            return (urlsplit(url.strip()).hostname or "").rstrip(".").lower()
        except ValueError:
            return ""
    shapes = ["http://a.com", "http://a.com/", "https://a.com:8080/x?y#z", "http://a.com?x=1",
              "http://a.com#f", "http://a.com.:80", "http://a.com:/p", "http://A.com/", "HTTP://a.com/",
              "http://user:pw@a.com/", "http://a.com@b.com/", "http://[::1]:80/", "http://127.0.0.1:5/",
              "  http://a.com/  ", "http://a.com\t/x", "http://a\tb.com/", "http://a.com:8x/",
              "http://a.com\\\\b.com/", "http:///path", "http://", "ftp://a.com/", "http://xn--bcher-kva.ch/",
              "http://bücher.ch/", "http://a.com:99999999/", "http://a_b.com/", "http://-a.com./.."]
    alphabet = "abcAZ09.-_:@/?#[]\\ \t%é"
    rng = random.Random(17)
    shapes += ["http://" + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
               for _ in range(5000)]
    fast = 0
    for url in shapes:
        assert site_of(url) == reference(url), url
        fast += _PLAIN_HOST.match(url.strip()) is not None
    assert fast > 100      # the fast path is taken, not only the fallback


def test_site_gate_gives_a_free_thread_to_the_site_with_the_fewest_fetches_running() -> None:
    """Two slots a site. Parked tasks start oldest first, from the site with the fewest
    fetches running; a site at its limit waits for one of its own to finish; site-less
    deliveries are not parked (the handler judges them); a drain takes every parked task."""
    from crawld.process.sitegate import SiteGate

    def delivery(site: str | None) -> Delivery:
        return Delivery(body=(site or "").encode(), message_id=None, attempt=1, redelivered=False,
                        origin="q", handle=None)
    gate = SiteGate(2, lambda d: d.body.decode() or None)
    a1, a2, a3, a4, b1, b2, bad = (delivery(s) for s in ["a", "a", "a", "a", "b", "b", None])
    assert [gate.park(d) for d in (a1, a2, a3, a4, b1, b2, bad)] == [True] * 6 + [False]
    assert gate.parked == 6
    assert gate.next() is a1 and gate.next() is b1       # one each before any site gets two
    assert gate.next() is a2 and gate.next() is b2
    assert gate.next() is None                           # a is at its limit, b has none left
    gate.finished(b1)
    assert gate.next() is None                           # b has a free slot but nothing parked
    gate.finished(a1)
    assert gate.next() is a3 and gate.parked == 1 and gate.next() is None
    c1 = delivery("c")
    assert gate.park(c1)
    gate.finished(a2)
    assert gate.next() is c1                             # c runs nothing: before a's second
    assert gate.next() is a4 and gate.parked == 0
    for d in (a3, a4, b2, c1):
        gate.finished(d)
    assert gate.park(a1) and gate.park(a2) and gate.park(a3)
    assert gate.discard(lambda d: d in (a2, b1)) == [a2] and gate.parked == 2     # given back by the broker
    assert gate.take_parked() == [a1, a3] and gate.parked == 0 and gate.next() is None
