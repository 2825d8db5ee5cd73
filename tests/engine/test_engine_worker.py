"""The forward worker: one thread, queued prefills before queued decode steps, FIFO otherwise,
errors handed to the caller, shutdown finishes queued work."""

from __future__ import annotations

import threading

import pytest

from hicache.engine.worker import DECODE, PREFILL, ForwardWorker


def test_prefills_jump_queued_decodes_and_order_is_fifo_within_a_priority() -> None:
    worker = ForwardWorker()
    gate = threading.Event()
    order: list[str] = []
    threads: set[str] = set()

    def job(name: str):
        def run() -> str:
            threads.add(threading.current_thread().name)
            order.append(name)
            return name
        return run

    blocker = worker.submit(gate.wait, DECODE)  # holds the thread while the queue fills
    futs = [worker.submit(job("d1"), DECODE), worker.submit(job("p1"), PREFILL),
            worker.submit(job("d2"), DECODE), worker.submit(job("p2"), PREFILL)]
    gate.set()
    assert [f.result(5) for f in futs] == ["d1", "p1", "d2", "p2"]
    assert blocker.result(5) is True
    assert order == ["p1", "p2", "d1", "d2"] and len(threads) == 1
    worker.shutdown()


def test_errors_reach_the_caller_and_shutdown_drains() -> None:
    worker = ForwardWorker()
    bad = worker.submit(lambda: 1 / 0)
    late = worker.submit(lambda: "done")
    worker.shutdown(wait=True)
    with pytest.raises(ZeroDivisionError):
        bad.result(5)
    assert late.result(0) == "done"
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(lambda: None)
