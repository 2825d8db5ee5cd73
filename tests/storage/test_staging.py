"""Pools without ``page_view``: pipelined chunks, reused staging, verify-then-commit.

The file backend on real files under ``tmp_path``; chunks are made small so that a batch of a
few pages spans several of them.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.storage import PoolTransfer, create_async_storage, staging
from hicache_backends.file.layout import page_id
from hicache.testing.pools import ArrayHostPool, RelocatingPool

PAGE = 4
ELEMS = 256  # 2 KiB pages (float16)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "CHUNK_BYTES", 3 * PAGE * ELEMS * 2)  # 3 pages a chunk


class CountingPool(ArrayHostPool):
    """A seed-protocol pool (copies out, staged in) that records what storage asked of it."""

    def __init__(self, *a: Any, fail_commit_at: int | None = None, **k: Any) -> None:
        super().__init__(*a, direct=False, **k)
        self.dummies = 0
        self.commits: list[int] = []
        self.fail_commit_at = fail_commit_at

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        self.dummies += 1
        return super().get_dummy_flat_data_page()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if index == self.fail_commit_at:
            raise RuntimeError("pool refuses this page")
        self.commits.append(index)
        super().set_from_flat_data_page(index, data_page)


def _keys(n: int) -> list[str]:
    return [f"page-{i}" for i in range(n)]


async def _opened(root: Path, pool: Any, seed: int) -> Any:
    """An open file store under ``root`` writing from ``pool`` (filled with random pages)."""
    pool.fill_random(seed)
    store = create_async_storage("file", None, root=str(root), namespace={"model": "staging-test"})
    store.register_mem_host_pool_v2(pool, "kv")
    await store.open()
    return store


async def _written(root: Path, n: int, seed: int) -> tuple[Any, CountingPool]:
    """An open file store under ``root`` holding pages ``page-0..n-1`` of a random pool."""
    src = CountingPool(16, PAGE, ELEMS)
    store = await _opened(root, src, seed)
    res = await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, n), keys=_keys(n))])
    assert res["kv"] == [True] * n
    return store, src


async def _get(store: Any, pool: Any, first_page: int, n: int) -> list[bool]:
    store.register_mem_host_pool_v2(pool, "kv")
    got = await store.batch_get_v2([PoolTransfer("kv", host_indices=pool.indices(first_page, n), keys=_keys(n))])
    return got["kv"]


async def test_round_trip_over_many_chunks_reuses_staging(tmp_path: Path) -> None:
    n = 10
    store, src = await _written(tmp_path, n, 1)
    try:
        dst = CountingPool(16, PAGE, ELEMS)
        for _ in range(2):
            dst.buffer.zero_()
            assert await _get(store, dst, 2, n) == [True] * n
            for i in range(n):
                assert dst.page_bytes((i + 2) * PAGE) == src.page_bytes(i * PAGE), i
        # one dummy page per pool to learn the staging shape, not one per batch or page
        assert dst.dummies == 1
        assert 0 < store._staging.idle_bytes <= store._staging.max_bytes
    finally:
        await store.aclose()


async def test_each_pool_object_is_asked_its_staging_shape(tmp_path: Path) -> None:
    """The staging shape is remembered per pool object: a new pool, even one at the same
    address after the old one is gone, is asked again; a pool of another page size read
    afterwards gets staging pages of its own size."""
    n = 4
    store, src = await _written(tmp_path, n, 5)
    try:
        first = CountingPool(16, PAGE, ELEMS)
        assert await _get(store, first, 0, n) == [True] * n
        second = CountingPool(16, PAGE, ELEMS)
        assert await _get(store, second, 0, n) == [True] * n
        assert (first.dummies, second.dummies) == (1, 1)
        del first, second
        for _ in range(3):  # new pools, possibly at a freed address: each asked once
            pool = CountingPool(16, PAGE, ELEMS)
            assert await _get(store, pool, 0, n) == [True] * n
            assert pool.dummies == 1
            for i in range(n):
                assert pool.page_bytes(i * PAGE) == src.page_bytes(i * PAGE), i
            del pool
        wider = CountingPool(16, PAGE, 2 * ELEMS)  # its pages are twice as long: no stored page fits
        assert await _get(store, wider, 0, n) == [False] * n
        assert wider.dummies == 1 and wider.commits == []
    finally:
        await store.aclose()


def test_arena_remembers_shapes_by_identity_not_by_value() -> None:
    arena = staging.StagingArena()
    pool = CountingPool(4, PAGE, ELEMS)
    like = pool.get_dummy_flat_data_page()
    arena.remember_like(pool, like)
    known = arena.known_like(pool)
    assert known is not None and known.shape == like.shape and known.dtype == like.dtype
    assert known.device.type == "meta"  # the shape only: no page of memory kept per pool
    assert arena.known_like(CountingPool(4, PAGE, ELEMS)) is None
    arena.remember_like(("not", "weakly", "referenceable"), like)  # skipped, not an error
    assert arena.known_like(("not", "weakly", "referenceable")) is None
    for _ in range(2 * arena.MAX_POOLS):  # bounded whatever the number of pools seen
        arena.remember_like(CountingPool(1, PAGE, ELEMS), like)
    assert len(arena._likes) <= arena.MAX_POOLS


async def test_a_corrupt_page_never_reaches_the_pool(tmp_path: Path) -> None:
    n = 7
    store, src = await _written(tmp_path, n, 2)
    try:
        files = sorted(p for p in tmp_path.rglob("*.page"))
        assert len(files) == n
        victim = files[3]  # one payload byte flipped on disk
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        dst = CountingPool(16, PAGE, ELEMS)
        sentinel = torch.full_like(dst.buffer, 7.0)
        dst.buffer.copy_(sentinel)
        got = await _get(store, dst, 0, n)
        assert sum(got) == n - 1 and store.get_stats()["corrupt_pages"] == 1
        bad = got.index(False)
        assert bad * PAGE not in dst.commits
        assert torch.equal(dst.buffer[bad * PAGE : (bad + 1) * PAGE], sentinel[: PAGE])  # untouched
        for i in range(n):
            if i != bad:
                assert dst.page_bytes(i * PAGE) == src.page_bytes(i * PAGE), i
    finally:
        await store.aclose()


async def test_pages_of_a_pool_whose_views_move_land_in_their_own_pages(tmp_path: Path) -> None:
    """Staged reads (2 KiB pages: too short to read straight into views) commit each page
    through ``set_from_flat_data_page`` even though every commit moves another page; a corrupt
    page is a miss and its page keeps its old bytes."""
    n = 6
    store, src = await _written(tmp_path, n, 6)
    try:
        victim = sorted(tmp_path.rglob("*.page"))[2]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        dst = RelocatingPool(n, PAGE, ELEMS)
        dst.physical.fill_(3.0)
        before = [dst.logical_bytes(i) for i in range(n)]
        got = await _get(store, dst, 0, n)
        assert sum(got) == n - 1 and dst.moves == n - 1
        for i in range(n):
            assert dst.logical_bytes(i) == (src.page_bytes(i * PAGE) if got[i] else before[i]), i
    finally:
        await store.aclose()


async def test_a_page_the_pool_refuses_fails_alone(tmp_path: Path) -> None:
    store, _ = await _written(tmp_path, 6, 3)
    try:
        dst = CountingPool(16, PAGE, ELEMS, fail_commit_at=4 * PAGE)
        assert await _get(store, dst, 0, 6) == [True, True, True, True, False, True]
        stats = store.get_stats()  # counted as refused; the sound page stays stored
        assert stats["pool_refused_pages"] == 1 and stats["corrupt_pages"] == 0
        assert await _get(store, CountingPool(16, PAGE, ELEMS), 0, 6) == [True] * 6
    finally:
        await store.aclose()


class NoDummyPool(CountingPool):
    def get_dummy_flat_data_page(self) -> torch.Tensor:
        raise RuntimeError("no scratch pages today")


async def test_a_pool_that_cannot_stage_gives_misses_not_errors(tmp_path: Path) -> None:
    store, _ = await _written(tmp_path, 3, 4)
    try:
        assert await _get(store, NoDummyPool(16, PAGE, ELEMS), 0, 3) == [False] * 3
    finally:
        await store.aclose()


class SlowCopyPool(CountingPool):
    """``get_data_page`` is slow: a write batch cancelled meanwhile must wait for it."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.copying = 0
        self.done = 0

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        self.copying += 1
        time.sleep(0.05)
        self.done += 1
        return super().get_data_page(index, flat)


async def test_cancelled_staged_write_waits_for_pool_copies(tmp_path: Path) -> None:
    src = SlowCopyPool(32, PAGE, ELEMS)
    store = await _opened(tmp_path, src, 5)
    try:
        task = asyncio.create_task(
            store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, 12), keys=_keys(12))])
        )
        while not src.copying:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        started = src.copying
        assert src.done == started  # every copy that began had finished before we got control
        await asyncio.sleep(0.2)
        assert src.copying == started  # and no new chunk started after the cancellation
    finally:
        await store.aclose()


def test_arena_bounds_idle_pages() -> None:
    arena = staging.StagingArena(max_bytes=3 * 1024)
    like = torch.empty(256, dtype=torch.float32)  # 1 KiB
    pages = arena.take(like, 5)
    assert len(pages) == 5 and all(p.shape == like.shape and p.dtype == like.dtype for p in pages)
    arena.give(pages)
    assert arena.idle_bytes == 3 * 1024
    again = arena.take(like, 2)
    assert {p.data_ptr() for p in again} <= {p.data_ptr() for p in pages}
    assert arena.take(torch.empty(8, dtype=torch.int64), 1)[0].dtype == torch.int64


async def test_a_truncated_page_is_a_counted_miss_and_the_pool_is_untouched(tmp_path: Path) -> None:
    n = 5
    store, src = await _written(tmp_path, n, 6)
    try:
        victim = sorted(tmp_path.rglob("*.page"))[2]
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # a short file
        dst = CountingPool(16, PAGE, ELEMS)
        dst.buffer.fill_(3.0)
        got = await _get(store, dst, 0, n)
        assert got.count(False) == 1 and store.get_stats()["corrupt_pages"] == 1
        bad = got.index(False)
        assert bad * PAGE not in dst.commits
        assert bool((dst.buffer[bad * PAGE : (bad + 1) * PAGE] == 3.0).all())
        assert not victim.exists()  # removed: the next read is a plain miss
        assert (await _get(store, dst, 0, n)).count(False) == 1
        assert store.get_stats()["corrupt_pages"] == 1
    finally:
        await store.aclose()


class WrongDummyPool(CountingPool):
    """Says its pages are ``page_nbytes`` long but hands out scratch pages of another size."""

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(PAGE * ELEMS // 2, dtype=self.dtype)


async def test_a_staging_page_of_the_wrong_size_is_a_clear_error_not_a_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, _ = await _written(tmp_path, 3, 7)
    try:
        dst = WrongDummyPool(16, PAGE, ELEMS)
        dst.buffer.fill_(5.0)
        assert await _get(store, dst, 0, 3) == [False] * 3
        assert "get_dummy_flat_data_page() is" in caplog.text and not dst.commits
        assert bool((dst.buffer == 5.0).all())
        assert store.get_stats()["corrupt_pages"] == 0  # the pages on disk are fine
    finally:
        await store.aclose()


class WrongPagePool(CountingPool):
    """``get_data_page`` of one page is short (a pool that lies about its page size)."""

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = super().get_data_page(index, flat)
        return page.reshape(-1)[: page.numel() // 2].clone() if index == 2 * PAGE else page


async def test_a_pool_page_of_the_wrong_size_fails_alone_with_a_clear_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = WrongPagePool(16, PAGE, ELEMS)
    store = await _opened(tmp_path, src, 8)
    try:
        res = await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(0, 4), keys=_keys(4))])
        assert res["kv"] == [True, True, False, True]
        assert store.get_stats()["pool_page_errors"] == 1
        assert "get_data_page(8) is 1024 bytes, a page is 2048" in caplog.text
        assert len(list(tmp_path.rglob("*.page"))) == 3  # nothing stored for the bad page
        dst = CountingPool(16, PAGE, ELEMS)
        assert await _get(store, dst, 0, 4) == [True, True, False, True]
    finally:
        await store.aclose()


async def test_staged_reads_reuse_a_few_warm_pages_not_one_per_page(tmp_path: Path) -> None:
    """Each page is read, verified and committed on one thread: the arena hands the same few
    staging pages round (at most one per I/O thread in use), however long the batch."""
    n = 12
    store, src = await _written(tmp_path, n, 10)
    try:
        dst = CountingPool(16, PAGE, ELEMS)
        taken: list[int] = []
        real_take = store._staging.take

        def take(like: torch.Tensor, k: int) -> list[torch.Tensor]:
            out = real_take(like, k)
            taken.extend(t.data_ptr() for t in out)
            return out

        store._staging.take = take  # type: ignore[method-assign]
        assert await _get(store, dst, 0, n) == [True] * n
        assert len(taken) == n and len(set(taken)) <= store.io_threads
        for i in range(n):
            assert dst.page_bytes(i * PAGE) == src.page_bytes(i * PAGE), i
    finally:
        await store.aclose()


async def test_a_foreign_page_is_a_counted_miss_and_the_pool_is_untouched(tmp_path: Path) -> None:
    """Another page's file at this page's path (a sound page, but of another key): the header
    names the wrong key, so the page is a counted miss and nothing of it reaches the pool."""
    n = 4
    store, src = await _written(tmp_path, n, 11)
    try:
        path = {i: Path(store.layout.path(page_id(f"page-{i}", "kv"))) for i in range(n)}
        path[1].write_bytes(path[2].read_bytes())  # page-2's file where page-1 belongs
        dst = CountingPool(16, PAGE, ELEMS)
        dst.buffer.fill_(9.0)
        assert await _get(store, dst, 0, n) == [True, False, True, True]
        assert store.get_stats()["corrupt_pages"] == 1 and PAGE not in dst.commits
        assert bool((dst.buffer[PAGE : 2 * PAGE] == 9.0).all())
        for i in (0, 2, 3):
            assert dst.page_bytes(i * PAGE) == src.page_bytes(i * PAGE), i
    finally:
        await store.aclose()


def test_staging_bytes_are_made_once_per_page_and_write_through() -> None:
    page = torch.zeros(4, 8, dtype=torch.bfloat16)
    view = staging.staging_bytes(page)
    assert staging.staging_bytes(page) is view  # kept on the page, not remade
    assert len(view) == page.numel() * page.element_size() and view.format == "B"
    view[:] = bytes(range(64))
    assert bytes(staging.as_bytes(page)) == bytes(range(64))


@pytest.mark.parametrize("backend", ["memory", "file"])
async def test_pages_outside_the_pool_are_counted_as_invalid_requests_by_every_backend(
    tmp_path: Path, backend: str
) -> None:
    """Host indices past the pool's end (or off a page boundary) fail those pages alone and are
    counted in ``invalid_requests``, whichever backend moves them. Before, the file backend
    (whose I/O threads copy pages out of and into the pool) counted them only under its own
    ``pool_page_errors`` / ``pool_refused_pages``: a dashboard of ``invalid_requests`` showed a
    caller writing to and reading from outside its pool as a healthy store."""
    src = CountingPool(16, PAGE, ELEMS)
    src.fill_random(9)
    options = {"root": str(tmp_path)} if backend == "file" else {}
    store = create_async_storage(backend, None, namespace={"model": "staging-test"}, **options)
    store.register_mem_host_pool_v2(src, "kv")
    try:
        outside = torch.cat([src.indices(0, 1), src.indices(16, 1), torch.arange(2, 2 + PAGE)])
        res = await store.batch_set_v2([PoolTransfer("kv", host_indices=outside, keys=_keys(3))])
        assert res["kv"] == [True, False, False]
        assert store.get_stats()["invalid_requests"] == 1  # one batch that named pages outside
        dst = CountingPool(16, PAGE, ELEMS)
        store.register_mem_host_pool_v2(dst, "kv")
        await store.batch_set_v2([PoolTransfer("kv", host_indices=src.indices(1, 1), keys=["other"])])
        got = await store.batch_get_v2([PoolTransfer("kv", host_indices=outside[:PAGE * 2], keys=[_keys(1)[0], "other"])])
        assert got["kv"] == [True, False]
        assert store.get_stats()["invalid_requests"] == 2
    finally:
        await store.aclose()
