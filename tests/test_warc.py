"""crawld.output.warc: real WARC files in tmp_path, read back by warcio and fastwarc."""
from __future__ import annotations

import glob
import hashlib
import gzip
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import zlib

import pytest
from warcio.archiveiterator import ArchiveIterator

import fastwarc.warc as fastwarc

from crawld.output.warc import (
    Exchange,
    WarcFileWriter,
    WarcLocation,
    _stored_member,
    payload_digest,
    read_record,
    recover,
    resolve,
    sha1_base32,
    stored_response_headers,
)

HOST = "testhost"
DAEMON_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "daemon")


def page(url: str, body: bytes = b"<html>ok</html>", status: int = 200, reason: str = "OK",
         **kw) -> Exchange:
    headers = kw.pop("response_headers", [("Content-Type", "text/html"),
                                          ("Content-Length", str(len(body)))])
    return Exchange(url, status, reason, response_headers=headers, payload=body,
                    request_headers=[("User-Agent", "crawld-test"), ("Accept", "*/*")],
                    ip_address="127.0.0.1", fetched_at=time.time(), **kw)


def writer(tmp_path, **kw) -> WarcFileWriter:
    return WarcFileWriter(str(tmp_path), hostname=HOST, **kw)


def warc_files(tmp_path) -> list[str]:
    return sorted(glob.glob(os.path.join(str(tmp_path), "*.warc.gz")))


def records(path: str) -> list:
    """(type, uri, headers) of every record, via warcio over the whole file."""
    with open(path, "rb") as f:
        return [(r.rec_type, r.rec_headers.get_header("WARC-Target-URI"), r.rec_headers)
                for r in ArchiveIterator(f)]


def warcio_check(paths: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "warcio.cli", "check", "-v", *paths],
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "digest fail" not in proc.stdout.lower()


def fastwarc_slice(tmp_path, loc: WarcLocation):
    """The record at loc, read by fastwarc from just that byte range; digests verified."""
    with open(resolve(loc.file, str(tmp_path)), "rb") as f:   # may still be .open
        f.seek(loc.offset)
        data = f.read(loc.length)
    # a fastwarc record is only valid while the iterator stands on it
    found = iter(fastwarc.ArchiveIterator(io.BytesIO(data), parse_http=False))
    rec = next(found)
    assert rec.verify_block_digest(consume=False)
    rec.parse_http()
    if rec.record_type == fastwarc.WarcRecordType.response:
        assert rec.verify_payload_digest(consume=False)
    info = (rec.record_type, dict(rec.headers), rec.http_headers.status_code, rec.reader.read())
    assert next(found, None) is None, "a location must hold exactly one record"
    return info


def check_location(tmp_path, loc: WarcLocation, hop: Exchange, rec_type: str = "response") -> None:
    rec = read_record(loc.file, loc.offset, loc.length, directory=str(tmp_path))
    assert rec.rec_type == rec_type
    assert rec.rec_headers.get_header("WARC-Target-URI") == hop.url
    assert rec.rec_headers.get_header("WARC-IP-Address") == hop.ip_address
    assert rec.http_headers.get_statuscode() == str(hop.status)
    body = rec.raw_stream.read()
    _, fw_headers, fw_status, fw_body = fastwarc_slice(tmp_path, loc)
    assert fw_headers["WARC-Target-URI"] == hop.url
    assert fw_status == hop.status
    if rec_type == "response":
        assert body == fw_body == hop.payload
        assert rec.rec_headers.get_header("WARC-Payload-Digest") == payload_digest(hop.payload)
        assert fw_headers["WARC-Payload-Digest"] == payload_digest(hop.payload)


def test_fetches_read_back_with_warcio_and_fastwarc(tmp_path):
    ok = [page("http://site.test/")]
    redirect = [page("http://site.test/old", b"", 301, "Moved Permanently",
                     response_headers=[("Location", "/mid"), ("Content-Length", "0")]),
                page("http://site.test/mid", b"moved", 302, "Found",
                     response_headers=[("Location", "/new"), ("Content-Length", "5")]),
                page("http://site.test/new", b"<html>new</html>")]
    missing = [page("http://site.test/missing", b"not here", 404, "Not Found")]
    cut = [page("http://site.test/big", b"x" * 1000, truncated=True,
                response_headers=[("Content-Type", "text/plain"), ("Content-Length", "99999")])]
    with writer(tmp_path) as w:
        written = [(hops, w.write_fetch(hops)) for hops in (ok, redirect, missing, cut)]
        w.sync()
        assert not w.needs_sync
    for hops, result in written:
        assert result.record_type == "response" and result.refers_to is None
        assert result.location == result.hops[-1] and len(result.hops) == len(hops)
        for hop, loc in zip(hops, result.hops):
            check_location(tmp_path, loc, hop)

    [path] = warc_files(tmp_path)
    assert os.path.basename(path) == written[0][1].location.file
    warcio_check([path])
    recs = records(path)
    assert [t for t, _, _ in recs].count("warcinfo") == 1 and recs[0][0] == "warcinfo"
    assert len(recs) == 1 + 2 * (1 + 3 + 1 + 1)
    # every request names its response, and carries the same target and date
    by_id = {h.get_header("WARC-Record-ID"): h for t, _, h in recs if t == "response"}
    requests = [h for t, _, h in recs if t == "request"]
    assert len(requests) == 6
    ids = [h.get_header("WARC-Record-ID") for _, _, h in recs]
    assert len(set(ids)) == len(ids)
    for record_id in ids:      # <urn:uuid:...> of a random (version 4, RFC 4122) UUID
        assert record_id.startswith("<urn:uuid:") and record_id.endswith(">"), record_id
        parsed = uuid.UUID(record_id[len("<urn:uuid:"):-1])
        assert str(parsed) == record_id[len("<urn:uuid:"):-1]
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122, record_id
    for req in requests:
        resp = by_id[req.get_header("WARC-Concurrent-To")]
        assert resp.get_header("WARC-Target-URI") == req.get_header("WARC-Target-URI")
        assert resp.get_header("WARC-Date") == req.get_header("WARC-Date")
    truncated = read_record(*written[3][1].location, directory=str(tmp_path))
    assert truncated.rec_headers.get_header("WARC-Truncated") == "length"
    assert truncated.http_headers.get_header("Content-Length") == "1000"
    assert truncated.http_headers.get_header("X-Crawld-Original-Content-Length") == "99999"
    info = records(path)[0][2]
    assert info.protocol == "WARC/1.1"
    assert info.get_header("WARC-Filename") == os.path.basename(path)


def test_request_record_is_the_request_as_sent(tmp_path):
    hop = page("http://user:pw@site.test:8080/a/b?x=1&y=2")
    with writer(tmp_path) as w:
        w.write_fetch([hop])
    [path] = warc_files(tmp_path)
    with open(path, "rb") as f:
        req = next(r for r in ArchiveIterator(f) if r.rec_type == "request")
        assert req.http_headers.protocol == "GET"
        assert req.http_headers.statusline == "/a/b?x=1&y=2 HTTP/1.1"
        assert req.http_headers.get_header("Host") == "site.test:8080"
        assert req.http_headers.get_header("User-Agent") == "crawld-test"


@pytest.mark.parametrize("size", [0, 1, 600, 65535, 65536, 200_000])
def test_stored_member_is_gzip_any_reader_reads(size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    member = _stored_member(data)
    assert gzip.decompress(member) == data
    inflate = zlib.decompressobj(zlib.MAX_WBITS + 16)
    assert inflate.decompress(member) == data and inflate.eof and not inflate.unused_data


def test_request_record_is_a_stored_member_and_the_response_deflated(tmp_path):
    """The request record (~600 bytes) skips deflate; warcio and fastwarc read both."""
    hop = page("http://site.test/p/1", b"<html>" + b"a page of text " * 200 + b"</html>")
    with writer(tmp_path) as w:
        written = w.write_fetch([hop])
    [path] = warc_files(tmp_path)
    raw = open(path, "rb").read()
    response = written.location
    request_at = response.offset + response.length          # the request follows its response
    assert raw[response.offset + 10] & 0b110 != 0           # BTYPE 01/10: deflated
    assert raw[request_at + 10] & 0b110 == 0                # BTYPE 00: stored
    warcio_check([path])
    assert [t for t, _, _ in records(path)] == ["warcinfo", "response", "request"]
    kinds = [r.record_type for r in fastwarc.ArchiveIterator(io.BytesIO(raw), parse_http=False)]
    assert kinds == [fastwarc.WarcRecordType.warcinfo, fastwarc.WarcRecordType.response,
                     fastwarc.WarcRecordType.request]


def test_decoded_body_headers_stay_consistent(tmp_path):
    headers = [("Content-Type", "text/html"), ("Content-Encoding", "gzip"),
               ("Transfer-Encoding", "chunked"), ("X-Odd", "caf\xe9")]
    hop = page("http://site.test/gz", b"<html>plain</html>", response_headers=headers)
    with writer(tmp_path) as w:
        loc = w.write_fetch([hop]).location
    rec = read_record(*loc, directory=str(tmp_path))
    http = rec.http_headers
    assert http.get_header("Content-Encoding") is None and http.get_header("Transfer-Encoding") is None
    assert http.get_header("X-Crawld-Original-Content-Encoding") == "gzip"
    assert http.get_header("X-Crawld-Original-Transfer-Encoding") == "chunked"
    assert http.get_header("Content-Length") == str(len(hop.payload))
    assert http.get_header("X-Odd") == "caf\xe9"        # latin-1 bytes kept, not %-encoded
    assert rec.content_stream().read() == hop.payload   # readers that decode see plain bytes
    warcio_check(warc_files(tmp_path))


def test_sha1_base32_is_rfc4648_base32():
    import base64
    import hashlib
    digests = [hashlib.sha1(os.urandom(n)).digest() for n in range(2000)] + [bytes(20), b"\xff" * 20]
    for digest in digests:
        assert sha1_base32(digest) == base64.b32encode(digest).decode("ascii")


def test_stored_headers_untouched_when_consistent():
    same = [("Content-Type", "text/html"), ("Content-Length", "3"), ("Content-Encoding", "identity")]
    assert stored_response_headers(same, 3) == same
    raw = [("Content-Encoding", "br"), ("Content-Length", "2")]
    assert stored_response_headers(raw, 2, decoded=False) == raw
    plain = [("Server", "nginx"), ("Content-Length", " 3 "), ("ETag", '"x"')]
    assert stored_response_headers(plain, 3) == plain
    assert stored_response_headers(plain, 4) == [("Server", "nginx"), ("X-Crawld-Original-Content-Length", " 3 "),
                                                 ("ETag", '"x"'), ("Content-Length", "4")]


def test_revisit_for_a_payload_already_written(tmp_path):
    body = b"<html>same everywhere</html>"
    with writer(tmp_path) as w:
        first = w.write_fetch([page("http://a.test/1", body)])
        second = w.write_fetch([page("http://a.test/2", body)])
        empty = [w.write_fetch([page(f"http://a.test/e{i}", b"", 204, "No Content")]) for i in range(2)]
    assert second.record_type == "revisit" and second.refers_to == first.location
    assert second.payload_digest == first.payload_digest
    assert all(e.record_type == "response" for e in empty)   # nothing to save on empty bodies
    rev = read_record(*second.location, directory=str(tmp_path))
    assert rev.rec_type == "revisit"
    assert rev.rec_headers.get_header("WARC-Profile") == \
        "http://netpreserve.org/warc/1.1/revisit/identical-payload-digest"
    assert rev.rec_headers.get_header("WARC-Refers-To-Target-URI") == "http://a.test/1"
    orig = read_record(*first.location, directory=str(tmp_path))
    assert rev.rec_headers.get_header("WARC-Refers-To-Date") == orig.rec_headers.get_header("WARC-Date")
    assert rev.rec_headers.get_header("WARC-Refers-To") == orig.rec_headers.get_header("WARC-Record-ID")
    fastwarc_slice(tmp_path, second.location)
    [path] = warc_files(tmp_path)
    assert len(records(path)) == 1 + 2 * 4
    warcio_check([path])


def test_revisits_off_truncated_never_deduped_and_map_bounded(tmp_path):
    with writer(tmp_path / "off", revisits=False) as w:
        assert [w.write_fetch([page(f"http://a.test/{i}", b"dup")]).record_type
                for i in range(2)] == ["response", "response"]
    with writer(tmp_path / "cut") as w:
        assert [w.write_fetch([page(f"http://a.test/{i}", b"dup", truncated=True)]).record_type
                for i in range(2)] == ["response", "response"]
    with writer(tmp_path / "lru", dedup_max_entries=2) as w:
        for body in (b"one", b"two", b"three"):
            w.write_fetch([page("http://a.test/x", body)])
        assert w.write_fetch([page("http://a.test/y", b"three")]).record_type == "revisit"
        assert w.write_fetch([page("http://a.test/y", b"one")]).record_type == "response"


def test_rolling_at_max_bytes(tmp_path):
    hops = [page(f"http://roll.test/{i}", os.urandom(1500)) for i in range(20)]
    with writer(tmp_path, max_bytes=5000) as w:
        locs = [w.write_fetch([h]).location for h in hops]
        assert len(w.closed_files) >= 4
    paths = warc_files(tmp_path)
    assert {loc.file for loc in locs} == {os.path.basename(p) for p in paths}
    assert len(paths) >= 5 and not glob.glob(os.path.join(str(tmp_path), "*.open"))
    total = 0
    for path in paths:
        recs = records(path)
        assert recs[0][0] == "warcinfo"
        assert recs[0][2].get_header("WARC-Filename") == os.path.basename(path)
        assert [t for t, _, _ in recs[1:]].count("warcinfo") == 0
        total += len(recs) - 1
    assert total == 2 * len(hops)
    for hop, loc in zip(hops, locs):
        check_location(tmp_path, loc, hop)
    warcio_check(paths)
    name = os.path.basename(paths[0])
    prefix, stamp, serial, rest = name.split("-", 3)
    assert prefix == "crawld" and len(stamp) == 17 and len(serial) == 5
    assert rest == f"{HOST}-{os.getpid()}.warc.gz"


def test_sync_is_one_fdatasync_per_batch_and_free_when_idle(tmp_path, monkeypatch):
    calls = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (calls.append(fd), real(fd)))
    with writer(tmp_path) as w:
        w.sync()
        assert calls == []
        for i in range(5):
            w.write_fetch([page(f"http://s.test/{i}", f"body {i}".encode())])
        assert w.needs_sync
        w.flush(fsync=True)
        assert len(calls) == 1 and not w.needs_sync
        w.sync()
        w.flush()
        assert len(calls) == 1


def test_open_file_is_readable_and_not_recovered_while_held(tmp_path):
    w = writer(tmp_path)
    hop = page("http://live.test/")
    loc = w.write_fetch([hop]).location
    assert glob.glob(os.path.join(str(tmp_path), "*.warc.gz.open"))
    check_location(tmp_path, loc, hop)          # read_record falls back to the .open name
    assert recover(str(tmp_path), hostname=HOST) == []   # our own flock says "alive"
    w.close()
    assert warc_files(tmp_path) == [os.path.join(str(tmp_path), loc.file)]


def test_concurrent_writers_from_8_threads(tmp_path):
    with writer(tmp_path, max_bytes=64 * 1024) as w:
        results: dict[str, tuple[Exchange, WarcLocation]] = {}
        lock = threading.Lock()

        def work(t: int) -> None:
            for i in range(25):
                hop = page(f"http://t{t}.test/{i}", os.urandom(300 + 37 * i))
                loc = w.write_fetch([hop]).location
                if i % 5 == 0:
                    w.sync()
                with lock:
                    results[hop.url] = (hop, loc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        w.sync()
    assert len(results) == 200
    for hop, loc in results.values():
        rec = read_record(*loc, directory=str(tmp_path))
        assert rec.rec_headers.get_header("WARC-Target-URI") == hop.url
        assert rec.raw_stream.read() == hop.payload
    paths = warc_files(tmp_path)
    assert len(paths) > 1
    assert sum(len(records(p)) - 1 for p in paths) == 400
    warcio_check(paths)


def test_concurrent_fetches_of_one_payload_give_one_response(tmp_path):
    """Eight threads at once with the same big payload (gzip takes long enough that they
    overlap): one response, seven revisits to it. Chains that carry two payloads in
    opposite orders do not wait on each other: one response per payload, the rest revisits."""
    big, other = os.urandom(3 << 20), os.urandom(2 << 20)
    barrier = threading.Barrier(8)
    with writer(tmp_path) as w:
        def fetch(hops: list[Exchange]):
            barrier.wait()
            return w.write_fetch(hops)

        same = run_threads(fetch, [[page(f"http://same.test/{i}", big)] for i in range(8)])
        crossing = run_threads(fetch, [[page(f"http://x.test/{i}/a", big if i % 2 else other),
                                        page(f"http://x.test/{i}/b", other if i % 2 else big)]
                                       for i in range(8)])
    kinds = sorted(r.record_type for r in same)
    assert kinds == ["response"] + ["revisit"] * 7
    original = next(r for r in same if r.record_type == "response")
    assert all(r.refers_to == original.location for r in same if r.record_type == "revisit")
    # `big` is already in the file; `other` gets one response, its 7 other hops revisits
    assert sum(1 for r in crossing for loc in r.hops
               if read_record(*loc, directory=str(tmp_path)).rec_type == "response") == 1
    warcio_check(warc_files(tmp_path))


def run_threads(target, args: list) -> list:
    results: list = [None] * len(args)

    def run(i: int) -> None:
        results[i] = target(args[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert None not in results
    return results


CHILD = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {daemon!r})
    from crawld.output.warc import Exchange, WarcFileWriter
    w = WarcFileWriter({directory!r}, hostname={host!r})
    torn = {torn!r}
    for i in range(10**6):
        hop = Exchange(f"http://kill.test/{{i}}", 200, "OK", payload=os.urandom(20000),
                       ip_address="127.0.0.1")
        loc = w.write_fetch([hop]).location
        print(loc.file, loc.offset, loc.length, hop.url, flush=True)
        if torn and i == 4:
            # die half way through a record, as a SIGKILL inside pwrite would
            member = open(os.path.join({directory!r}, loc.file + ".open"), "rb").read()
            member = member[loc.offset:loc.offset + loc.length]
            os.pwrite(w._fd, member[: len(member) // 2], w._size)
            print("TORN", flush=True)
            time.sleep(60)
""")


def run_child_and_kill(tmp_path, torn: bool, records_wanted: int) -> list[tuple[WarcLocation, str]]:
    script = CHILD.format(daemon=DAEMON_DIR, directory=str(tmp_path), host=HOST, torn=torn)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    written = []
    try:
        for line in child.stdout:
            if line.strip() == "TORN":
                break
            name, offset, length, url = line.split()
            written.append((WarcLocation(name, int(offset), int(length)), url))
            if len(written) >= records_wanted and not torn:
                break
        # alive writer: recover must leave its file alone
        assert recover(str(tmp_path), hostname=HOST) == []
        os.kill(child.pid, signal.SIGKILL)
        # not reaped yet: a zombie counts as dead
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{child.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        return written
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


@pytest.mark.parametrize("torn", [False, True], ids=["sigkill", "torn-tail"])
def test_crash_recovery(tmp_path, torn):
    written = run_child_and_kill(tmp_path, torn, records_wanted=8)
    [open_file] = glob.glob(os.path.join(str(tmp_path), "*.warc.gz.open"))
    size_before = os.path.getsize(open_file)
    other_host = os.path.join(str(tmp_path), os.path.basename(open_file).replace(HOST, "elsewhere"))
    with open(other_host, "wb"):
        pass

    [result] = recover(str(tmp_path), hostname=HOST)
    assert not os.path.exists(open_file) and os.path.exists(other_host)
    assert result.path == open_file[: -len(".open")]
    assert os.path.getsize(result.path) == size_before - result.bytes_dropped
    if torn:
        assert result.bytes_dropped > 0
    recs = records(result.path)              # would raise on a partial member
    assert recs[0][0] == "warcinfo" and len(recs) == result.records
    assert len(recs) >= 1 + 2 * len(written)
    for loc, url in written:
        rec = read_record(*loc, directory=str(tmp_path))
        assert rec.rec_headers.get_header("WARC-Target-URI") == url
        fastwarc_slice(tmp_path, loc)
    warcio_check([result.path])
    assert recover(str(tmp_path), hostname=HOST) == []   # idempotent


def test_recover_cuts_garbage_and_removes_empty_files(tmp_path):
    w = WarcFileWriter(str(tmp_path), hostname=HOST, pid=2 ** 22 + 1)   # a pid no process has
    locs = [w.write_fetch([page(f"http://g.test/{i}")]).location for i in range(3)]
    name = os.path.join(str(tmp_path), locs[0].file + ".open")
    os.close(w._fd)                                        # the process "dies": lock dropped
    good = os.path.getsize(name)
    with open(name, "ab") as f:
        f.write(gzip.compress(b"WARC/1.1\r\nContent-Length: 500\r\n\r\nshort"))   # whole member, bad record
        f.write(b"\0" * 4096)                              # zero fill after a power cut
    empty = os.path.join(str(tmp_path), f"crawld-20240101000000000-00007-{HOST}-{2 ** 22 + 2}.warc.gz.open")
    with open(empty, "wb") as f:
        f.write(gzip.compress(b"WARC/1.1\r\n")[:10])
    results = {os.path.basename(r.path): r for r in recover(str(tmp_path), hostname=HOST)}
    assert results[os.path.basename(empty)].removed and not os.path.exists(empty)
    kept = results[locs[0].file]
    assert kept.records == 1 + 2 * 3 and os.path.getsize(kept.path) == good
    for loc in locs:
        fastwarc_slice(tmp_path, loc)
    warcio_check([kept.path])


def test_closed_writer_refuses_writes(tmp_path):
    w = writer(tmp_path)
    w.close()
    w.close()
    with pytest.raises(ValueError):
        w.write_fetch([page("http://x.test/")])
    with pytest.raises(ValueError):
        w.write_fetch([])
    assert warc_files(tmp_path) == []


@pytest.mark.parametrize("sizes", [(0,), (2047,), (2048,), (2600,), (300, 2600), (5000, 11000), (17000,),
                                   (1000, 16000)])
def test_hashed_equals_one_update_and_keeps_small_updates_under_the_gil_threshold(sizes):
    """``hashed`` gives hashlib's digest; at most HELD_MAX bytes go in updates below the
    size at which hashlib gives up the GIL, larger inputs in one update per part."""
    from crawld.output.digests import HASHLIB_GIL_MINSIZE, HELD_MAX, hashed
    parts = [os.urandom(n) for n in sizes]
    for algo in (hashlib.sha1, hashlib.sha256):
        assert hashed(algo, *parts).hexdigest() == algo(b"".join(parts)).hexdigest()

    updates: list[int] = []

    class Recording:
        def update(self, data: bytes) -> None:
            updates.append(len(data))

    hashed(Recording, *parts)
    assert sum(updates) == sum(sizes)
    if sum(sizes) <= HELD_MAX:
        assert max(updates, default=0) < HASHLIB_GIL_MINSIZE
    else:
        assert updates == [n for n in sizes]
