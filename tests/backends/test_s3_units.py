"""The s3 backend's parts on their own, no server: breaker, retry classification, existence
cache, object names and redaction."""

from __future__ import annotations

import errno

import pytest

from hicache_backends.s3.breaker import BreakerState, CircuitBreaker
from hicache_backends.s3.cache import ExistsCache
from hicache_backends.s3.naming import ObjectNames, Redactor, redact_options, redact_url
from hicache_backends.s3.retry import RetryPolicy, is_throttle, is_transient


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_probes_and_recovers() -> None:
    clock = Clock()
    b = CircuitBreaker(threshold=3, cooldown=2.0, clock=clock)
    assert b.allow()
    assert not b.record_failure() and not b.record_failure()
    b.record_success()  # success resets the count: failures must be consecutive
    assert not b.record_failure() and not b.record_failure()
    assert b.record_failure() and b.state is BreakerState.OPEN and b.times_opened == 1
    assert not b.allow()
    clock.now = 2.0
    assert b.allow() and b.state is BreakerState.HALF_OPEN  # the one probe
    assert not b.allow()  # everyone else waits for it
    assert b.record_failure() and b.state is BreakerState.OPEN  # failed probe re-opens
    clock.now = 3.0
    assert not b.allow()
    clock.now = 4.0
    assert b.allow()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allow()


def test_breaker_lost_probe_does_not_wedge() -> None:
    clock = Clock()
    b = CircuitBreaker(threshold=1, cooldown=1.0, clock=clock)
    b.record_failure()
    clock.now = 1.0
    assert b.allow()  # probe goes out and is cancelled: no outcome recorded
    assert not b.allow()
    clock.now = 2.0
    assert b.allow()  # after another cool-down someone else probes


def _client_error(status: int, code: str) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


def test_retry_classification() -> None:
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError

    assert is_transient(TimeoutError())
    assert is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(ConnectTimeoutError(endpoint_url="http://x"))
    assert is_transient(ConnectionResetError())
    assert is_transient(_client_error(503, "SlowDown")) and is_throttle(_client_error(503, "SlowDown"))
    assert is_transient(_client_error(500, "InternalError"))
    assert is_transient(_client_error(429, "TooManyRequests"))
    assert not is_transient(_client_error(404, "NoSuchKey"))
    assert not is_transient(_client_error(403, "AccessDenied"))
    assert not is_transient(_client_error(416, "InvalidRange"))
    assert not is_transient(FileNotFoundError("x")) and not is_transient(PermissionError("x"))
    # s3fs turns ClientErrors into OSErrors and keeps the original as the cause
    wrapped = OSError(errno.EIO, "boom")
    wrapped.__cause__ = _client_error(502, "BadGateway")
    assert is_transient(wrapped)
    wrapped = OSError(errno.EIO, "boom")
    wrapped.__cause__ = _client_error(400, "InvalidRequest")
    assert not is_transient(wrapped)
    assert is_transient(OSError(errno.EBUSY, "slow down"))
    assert not is_transient(ValueError("bug"))


def test_retry_backoff_is_capped_and_jittered() -> None:
    p = RetryPolicy(retries=3, backoff=0.1, backoff_max=0.5)
    assert p.attempts == 4
    for attempt in range(6):
        d = p.delay(attempt)
        cap = min(0.5, 0.1 * 2**attempt)
        assert cap / 2 <= d <= cap
    assert p.delay(0, throttled=True) > 0.1  # throttling backs off harder
    with pytest.raises(ValueError):
        RetryPolicy(retries=-1)


def test_exists_cache_ttl_lru_and_generations() -> None:
    clock = Clock()
    c = ExistsCache(max_entries=2, ttl=10.0, clock=clock)
    g = c.generation
    c.add("a", g)
    c.add("b", g)
    assert c.contains("a")  # a is now most recent
    c.add("c", g)
    assert c.contains("a") and c.contains("c") and not c.contains("b")
    clock.now = 11.0
    assert not c.contains("a")  # expired
    c.add("d", c.generation)
    old = c.generation
    c.clear()
    assert not c.contains("d")
    c.add("e", old)  # an answer from before the clear is dropped
    assert not c.contains("e")
    c.add("e", c.generation)
    assert c.contains("e")
    c.discard("e")
    assert not c.contains("e")
    off = ExistsCache(max_entries=0, ttl=10.0)
    off.add("x", off.generation)
    assert not off.contains("x")


def test_exists_cache_gone_marks_until_a_fresh_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache_backends.s3 import cache as cache_mod

    monkeypatch.setattr(cache_mod, "_MIN_GONE", 2)
    off = ExistsCache(max_entries=0, ttl=10.0, clock=Clock())  # positive answers off, marks kept
    off.mark_gone("x")
    assert off.is_gone("x") and not off.contains("x")
    off.add("x", off.generation)  # a fresh answer clears the mark even with the cache off
    assert not off.is_gone("x") and not off.contains("x")
    c = ExistsCache(max_entries=2, ttl=10.0, clock=Clock())
    c.add("a", c.generation)
    assert c.mark_gone("a") is True  # it was believed present
    assert not c.contains("a") and c.is_gone("a")
    assert c.mark_gone("b") is False and c.is_gone("b")  # never known: a miss, not stale
    c.mark_gone("c")  # bounded like the entries: the oldest mark goes
    assert not c.is_gone("a") and c.is_gone("b") and c.is_gone("c")
    c.add("b", c.generation)  # a fresh answer (HEAD, read, write) clears the mark
    assert not c.is_gone("b") and c.contains("b")
    assert c.discard("b") is True and c.discard("b") is False
    c.clear()
    assert not c.is_gone("c")


def test_object_names_hash_keys_and_pools() -> None:
    names = ObjectNames("bucket/prefix/", "ab" * 16)
    assert names.manifest == f"bucket/prefix/{'ab' * 16}/manifest.json"
    p1 = names.page("../../etc/passwd", "kv")
    assert p1.startswith(names.pages_dir + "/") and ".." not in p1.split(names.pages_dir)[1]
    assert names.page("k", "kv") != names.page("k", "mamba")
    assert names.page("1k", "kv") != names.page("k", "kv1")  # (pool, key) pairs never collide
    assert names.page("k", "kv") == ObjectNames("bucket/prefix", "ab" * 16).page("k", "kv")


def test_redaction() -> None:
    assert redact_url("s3://AKIA:se/cr@et@bucket/p") == "s3://***@bucket/p"
    assert redact_url("s3://bucket/p") == "s3://bucket/p"
    opts = {
        "key": "AKIA1", "secret": "s3cr3t", "token": "tok3n", "endpoint_url": "http://u:pw@h:1",
        "client_kwargs": {"aws_secret_access_key": "s3", "region_name": "r"},
    }
    shown = repr(redact_options(opts))
    for s in ("AKIA1", "s3cr3t", "tok3n", ":pw@"):
        assert s not in shown
    assert "'region_name': 'r'" in shown
    r = Redactor(opts, "s3://K:S3CRET@b/x")
    assert r.scrub("failed with s3cr3t and AKIA1 at http://u:pw@h:1 S3CRET") == "failed with *** and *** at http://***@h:1 ***"


def test_body_buffers_reuse_by_size_and_stay_bounded() -> None:
    from hicache_backends.s3.bodies import BodyBuffers

    b = BodyBuffers(max_buffers=2, max_bytes=300)
    one = b.take(100)
    assert len(one) == 100 and len(b) == 0
    b.give_back(one)
    assert b.take(100) is one and len(b) == 0  # reused
    assert b.take(50) is not one  # another size: a new buffer
    for buf in (bytearray(100), bytearray(100), bytearray(100)):
        b.give_back(buf)
    assert len(b) == 2  # by count
    b = BodyBuffers(max_buffers=8, max_bytes=150)
    b.give_back(bytearray(100))
    b.give_back(bytearray(100))
    assert len(b) == 1  # by bytes
