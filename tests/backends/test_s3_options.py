"""The ``s3`` backend's ``storage_options`` against a moto S3 server on loopback: options that
can never work are a :class:`ConfigError` naming the option when the store opens (they opened,
then every call missed, with a warning a minute), while a service that is down or a bucket that
is missing at open stay misses the store recovers from."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from hicache.errors import ConfigError
from hicache.storage import create_async_storage
from hicache.testing.store_tests import NS_A
from s3_server import TEST_SECRET, create_bucket, free_port, s3_options, shared_session

FAST: dict[str, Any] = dict(request_timeout=1.0, call_timeout=3.0, retries=0, breaker_threshold=5)


def _store(endpoint: str, bucket: str, **options: Any) -> Any:
    opts = {**s3_options(endpoint), "session": shared_session(), **options}
    return create_async_storage("s3", None, url=f"s3://{bucket}/opts/{uuid.uuid4().hex}",
                                storage_options={k: v for k, v in opts.items() if v is not None},
                                namespace=NS_A, **FAST)


@pytest.mark.parametrize(("options", "named"), [
    ({"endpoint_url": "not a url"}, "endpoint_url"),
    ({"endpoint_url": "ftp://127.0.0.1:9000"}, "endpoint_url"),
    ({"endpoint_url": "http://"}, "endpoint_url"),
    ({"client_kwargs": {"region_name": "us-east-1", "endpoint_url": "gopher://x"}}, "endpoint_url"),
    ({"client_kwargs": {"region_name": "us-east-1", "no_such_option": 1}}, "no_such_option"),
    ({"config_kwargs": {"no_such_option": 1}}, "no_such_option"),
    ({"session": None, "no_such_option": 1}, "no_such_option"),  # (given a session, s3fs ignores it)
    ({"client_kwargs": {"region_name": 5}}, "region_name"),
    ({"config_kwargs": {"region_name": ["us-east-1"]}}, "region_name"),
    ({"client_kwargs": ["us-east-1"]}, "client_kwargs"),
    ({"config_kwargs": "retries"}, "config_kwargs"),
    ({"client_kwargs": {"region_name": "us east 1"}}, "region_name"),
    ({"session": None, "profile": f"no-such-profile-{uuid.uuid4().hex[:6]}"}, "profile"),
    ({"secret": None}, "secret"),
    ({"config_kwargs": {"retries": "adaptive"}}, "retries"),
    ({"config_kwargs": {"retries": {"mode": "eager"}}}, "mode"),
    ({"config_kwargs": {"retries": {"max_attempts": -1}}}, "max_attempts"),
    ({"config_kwargs": {"connect_timeout": "5"}}, "connect_timeout"),
    ({"config_kwargs": {"read_timeout": -5}}, "read_timeout"),
    ({"config_kwargs": {"signature_version": "v9"}}, "signature_version"),
    ({"s3_additional_kwargs": "AES256"}, "s3_additional_kwargs"),
    ({"session": "default"}, "session"),
    ({"client_kwargs": {"region_name": "us-east-1", "api_version": "1999-01-01"}}, "1999-01-01"),
    ({"client_kwargs": {"region_name": "us-east-1", "verify": "/no/such/ca-bundle.pem"}}, "verify"),
], ids=["not-a-url", "ftp", "no-host", "client-endpoint", "client-kwarg", "config-kwarg", "fs-kwarg",
        "region-int", "config-region-list", "client-kwargs-list", "config-kwargs-text", "region-format",
        "profile", "key-without-secret", "retries-text", "retry-mode", "retry-attempts", "connect-timeout-text",
        "read-timeout-negative", "signature-version", "additional-kwargs-text", "session-text", "api-version",
        "ca-bundle-missing"])
async def test_options_that_can_never_work_are_a_config_error_at_open(
    moto_endpoint: str, moto_bucket: str, options: dict[str, Any], named: str
) -> None:
    """Each of these opened the store, which then missed every call for good with a warning a
    minute (the client is built on the first request, and its refusal was counted as a
    permanent error of that request): a one-line ConfigError naming the option now, with no
    secret in it."""
    with pytest.raises(ConfigError, match=named) as info:
        store = _store(moto_endpoint, moto_bucket, **options)
        try:
            await store.open()
        finally:
            await store.aclose()
    message = str(info.value)
    assert "\n" not in message and TEST_SECRET not in message


async def test_a_service_that_is_down_or_a_missing_bucket_still_open_and_recover(
    moto_endpoint: str,
) -> None:
    """What may mend by itself is no configuration error: an endpoint that refuses connections
    and a bucket that does not exist yet both open, answer misses, and work once there."""
    down = _store(f"http://127.0.0.1:{free_port()}", "anything")
    async with down:
        assert await down.exists("k") is False
    bucket = f"later-{uuid.uuid4().hex[:10]}"
    store = _store(moto_endpoint, bucket)
    async with store:
        assert await store.exists("k") is False
        create_bucket(moto_endpoint, bucket)
        import torch

        page = torch.arange(16, dtype=torch.float32)
        assert await store.set("k", page) is True
        got = await store.get("k", torch.empty(16))
        assert got is not None and torch.equal(got, page)


@pytest.mark.parametrize("bucket", ["bad!bucket", "a b", "bkt:1", "b" * 256])
def test_a_bucket_name_botocore_refuses_is_a_config_error(bucket: str) -> None:
    """botocore refuses such a bucket name before any request is sent: the store opened, and
    every call was a permanent error for good (a multi-line warning a minute)."""
    with pytest.raises(ConfigError, match="bucket"):
        create_async_storage("s3", None, url=f"s3://{bucket}/kv", storage_options={"endpoint_url": "http://h:1"})


def test_an_access_point_arn_is_not_refused_as_a_bucket_name() -> None:
    create_async_storage("s3", None, url="s3://arn:aws:s3:us-east-1:123456789012:accesspoint/ap/kv")
