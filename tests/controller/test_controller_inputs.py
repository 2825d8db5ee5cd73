"""Malformed work handed to the controller is the caller's error, never the store's: a bad
write job is refused where it is submitted, and a storage call that raises on a bad key does
not count against the store's health (before, three such calls marked a good store down and
every later write was skipped)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from hicache.controller import ControllerConfig
from hicache.controller.jobs import StorageWriteJob
from hicache.errors import InvalidKeyError, LoopMisuseError
from hicache.stack import StackConfig, build_stack

PS = 4


@pytest.fixture
async def stack():
    st = build_stack(StackConfig(page_size=PS, storage_options={"store_id": uuid.uuid4().hex},
                                 controller=ControllerConfig(prefetch_threshold=0, storage_retry_base_s=0.001)))
    await st.controller.open_storage()
    yield st
    await st.aclose()


def job(keys, host, done):  # type: ignore[no-untyped-def]
    return StorageWriteJob(keys=keys, host_indices=host, prior_key=None, on_done=done.append)


async def test_a_malformed_write_job_is_refused_at_submit(stack) -> None:  # type: ignore[no-untyped-def]
    host = stack.host_pool.alloc(2 * PS)
    done: list[int] = []
    c = stack.controller
    for keys, indices, error in [
        (["a", "b", "c"], host, ValueError),  # fewer host indices than pages
        (["a"], host, ValueError),  # more
        (["", "b"], host, InvalidKeyError),
        (["a", "b\x00"], host, InvalidKeyError),
        (["a", "b"], host.float(), ValueError),
        (["a", "b"], host.view(2, PS), ValueError),
    ]:
        with pytest.raises(error):
            c.submit_storage_write(job(keys, indices, done))
    assert c.submit_storage_write(job(["a", "b"], host, done))
    await c.drain()
    assert done == [2]
    assert c.health.up


async def test_a_bad_key_in_a_storage_call_does_not_mark_the_store_down(stack) -> None:  # type: ignore[no-untyped-def]
    c = stack.controller
    host = stack.host_pool.alloc(PS)
    for i in range(c.config.storage_health_errors + 2):
        op = c.start_prefetch(f"r{i}", ["", "k"], alloc_host=lambda n: stack.host_pool.alloc(n))
        assert op is not None
        await c.wait_prefetch(f"r{i}", "wait_complete")
        c.take_prefetch(f"r{i}")
    assert c.health.up
    assert c.metrics.counters["storage_trips"] == 0
    done: list[int] = []
    assert c.submit_storage_write(job(["good"], host, done))
    await c.drain()
    assert done == [1]


async def test_a_prefetch_started_off_the_loops_thread_is_refused_and_holds_nothing(stack) -> None:  # type: ignore[no-untyped-def]
    """A call from another thread (an engine's worker, a metrics thread) registered the op and
    its tokens, then failed to start its task there (``no running event loop``): the rid stayed
    taken and its tokens held the in-flight budget for good. It is refused before anything is
    held now, and the same rid starts on the loop afterwards."""
    c = stack.controller
    c.start()
    alloc = lambda n: stack.host_pool.alloc(n)  # noqa: E731
    with pytest.raises(LoopMisuseError):
        await asyncio.to_thread(c.start_prefetch, "r", ["a", "b"], alloc_host=alloc)
    assert (c._prefetcher.inflight, c._prefetcher.inflight_tokens) == (0, 0)
    assert c.metrics.counters.get("prefetch_started", 0) == 0
    assert c.start_prefetch("r", ["a", "b"], alloc_host=alloc) is not None
    await c.wait_prefetches()
    assert c.take_prefetch("r") is not None
