"""Device->host copies queued by many callers are joined into one copy: each job is checked on
its own, and a job that fails the joined copy fails alone."""

from __future__ import annotations

import pytest
import torch

from hicache.controller import ControllerConfig
from hicache.replay import StackConfig, build_stack

PS = 4


def pages(*ps: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in ps])


def _stack():  # type: ignore[no-untyped-def]
    stack = build_stack(StackConfig(page_size=PS, device_pages=16, host_pages=64, storage_backend=None,
                                    controller=ControllerConfig()))
    kv = stack.device_pool.kv_data
    for p in range(kv.shape[2] // PS):  # device page p holds the value p in every layer
        kv[:, :, p * PS:(p + 1) * PS] = p
    return stack


def host_value(stack, page: int) -> float:  # type: ignore[no-untyped-def]
    vals = stack.host_pool.get_data_page(page * PS, flat=True).unique()
    return float(vals[0]) if vals.numel() == 1 else float("nan")


async def test_a_job_whose_sides_differ_is_refused_at_submit() -> None:
    """Two such jobs whose errors cancel out were joined into one copy that paired one job's
    pages with the other's host pages, and both reported success."""
    stack = _stack()
    try:
        with pytest.raises(ValueError, match="whole pages"):
            stack.controller.submit_backup(pages(1, 2), pages(10), lambda ok: None)
        with pytest.raises(ValueError, match="whole pages"):
            await stack.controller.backup(pages(3), pages(11)[:2])
    finally:
        await stack.aclose()


async def test_a_job_that_fails_the_joined_copy_fails_alone() -> None:
    stack = _stack()
    ctl = stack.controller
    res: dict[str, bool] = {}
    try:
        assert ctl.submit_backup(pages(1), pages(20), lambda ok: res.__setitem__("good", ok))
        assert ctl.submit_backup(pages(2), torch.arange(10**6, 10**6 + PS), lambda ok: res.__setitem__("bad", ok))
        assert ctl.submit_backup(pages(3), pages(21), lambda ok: res.__setitem__("after", ok))
        await ctl.drain()
        assert res == {"good": True, "bad": False, "after": True}
        assert (host_value(stack, 20), host_value(stack, 21)) == (1.0, 3.0)
        assert ctl.metrics.counters["backup_failures"] == 1
    finally:
        await stack.aclose()


async def test_the_backup_worker_outlives_a_copy_its_shared_executor_dropped() -> None:
    """A copy engine on an executor another owner shuts down (``cancel_futures``): the dropped
    copy fails its job (counted), and the worker goes on. It took the drop for its own
    cancellation and stopped, silently: every later backup was queued forever and ``drain``
    hung."""
    import asyncio
    import concurrent.futures
    import threading

    from hicache.memory import CopyEngine

    stack = _stack()
    shared = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    gate = threading.Event()
    shared.submit(gate.wait, 10)
    own_engine = stack.controller.copy_engine
    stack.controller.copy_engine = CopyEngine(stack.device_pool, stack.host_pool, executor=shared,
                                              inline_max_bytes=0)
    try:
        results: list[bool] = []
        assert stack.controller.submit_backup(pages(1), pages(20), results.append)
        await asyncio.sleep(0.05)  # the worker handed the copy to the executor
        shared.shutdown(wait=False, cancel_futures=True)
        gate.set()
        await asyncio.wait_for(stack.controller.drain(), 5)
        assert results == [False] and stack.controller.metrics.counters["backup_failures"] == 1
        stack.controller.copy_engine = own_engine  # a healthy engine again: backups copy
        assert stack.controller.submit_backup(pages(2), pages(21), results.append)
        await asyncio.wait_for(stack.controller.drain(), 5)
        assert results == [False, True] and host_value(stack, 21) == 2.0
    finally:
        stack.controller.copy_engine = own_engine
        await stack.aclose()
