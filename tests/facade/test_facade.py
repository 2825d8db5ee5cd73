"""The HiCache facade: lifecycle, the request path on every tier, sessions, aborts, metrics.

KV is "computed" deterministically from token ids (``hicache.replay.synthetic``), so every
restored slot is checked bit for bit against what a full recompute would write.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from hicache.errors import CacheClosedError, OutOfKVSlotsError
from hicache.facade import HiCache
from hicache.observability.scrape import Scrape
from hicache.replay.synthetic import verify_kv, write_synthetic_kv

PS = 16


def config(tmp_path: Path | None = None, **over) -> dict:
    storage = (
        {"backend": "file", "options": {"root": str(tmp_path / "store")}}
        if tmp_path is not None
        else {"backend": "memory", "options": {"store_id": uuid.uuid4().hex}}
    )
    cfg = {
        "model": {"name": "test/facade", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        "device": {"device": "cpu", "size_tokens": 64 * PS, "page_size": PS, "max_requests": 8, "max_context_len": 2048},
        "host": {"ratio": 4.0},
        "storage": storage,
        "cache": {"prefetch": {"policy": "wait_complete", "threshold_tokens": 0}},
        "session": {"reap_interval_s": None},
    }
    for section, values in over.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


async def run(cache: HiCache, rid: str, tokens: list[int], session_id: str | None = None):
    """One request the way a server runs it: begin, check the reused prefix, compute the rest."""
    h = await cache.begin(rid, tokens, session_id=session_id)
    for layer in range(cache.device_pool.layer_num):
        await h.wait_layer(layer)
    t = torch.tensor(tokens)
    assert verify_kv(cache.device_pool, h.kv_indices[: h.prefix_len], t[: h.prefix_len]) == 0
    write_synthetic_kv(cache.device_pool, h.kv_indices[h.prefix_len :], t[h.prefix_len :])
    await cache.commit(h, finished=True)
    return h


def prompt(seed: int, n: int) -> list[int]:
    return [seed * 10_000 + i for i in range(n)]


async def test_lifecycle() -> None:
    cache = HiCache.from_config(config())
    with pytest.raises(CacheClosedError, match="not started"):
        await cache.begin("r", [1, 2, 3])
    async with cache:
        h = await run(cache, "r0", prompt(1, 40))
        assert h.prefix_len == 0
    await cache.aclose()  # double close is safe
    with pytest.raises(CacheClosedError, match="closed"):
        await cache.begin("r1", [1])
    with pytest.raises(CacheClosedError):
        await cache.start()


async def test_device_then_host_hits_restore_exact_kv() -> None:
    async with HiCache.from_config(config()) as cache:
        shared = prompt(2, 5 * PS)
        await run(cache, "a", shared + prompt(3, 20))
        h = await run(cache, "b", shared + prompt(4, 20))
        assert h.hits["device"] >= 5 * PS and h.prefix_len >= 5 * PS
        # flood the device pool so the shared prefix is demoted to host
        for i in range(12):
            await run(cache, f"flood{i}", prompt(100 + i, 10 * PS))
        await cache.drain()
        h = await run(cache, "c", shared + prompt(5, 7))
        assert h.hits["host"] > 0, h.hits
        assert h.prefix_len == 5 * PS
        await cache.drain()  # transfer metrics are recorded when each copy's watcher finishes
        m = cache.metrics()
        assert m["controller"]["hit_tokens"]["host"] > 0
        assert m["controller"]["bytes"]["h2d"] > 0 and m["controller"]["bytes"]["d2h"] > 0
        scrape = Scrape(cache.prometheus_text())
        mine = {"cache": cache.metrics_label}
        assert scrape.value("hicache_hit_tokens_total", tier="host", **mine) == m["controller"]["hit_tokens"]["host"]
        assert scrape.value("hicache_device_free_tokens", **mine) == m["device"]["free_tokens"]
        assert scrape.value("hicache_backend_write_ok_total", backend="memory", **mine) == m["storage"]["write_ok"]
        assert scrape.value("hicache_backend_stored_pages", backend="memory", **mine) is not None
        assert scrape.value("hicache_operation_seconds_count", op="load_back", tier="host", **mine) >= 1
        assert scrape.value("hicache_operation_seconds_count", op="backup", tier="host", **mine) >= 1
        assert scrape.value("hicache_session_turns_total", **mine) is not None


async def test_storage_round_trip_across_restart(tmp_path: Path) -> None:
    tokens = prompt(7, 6 * PS + 5)
    async with HiCache.from_config(config(tmp_path)) as first:
        await run(first, "w", tokens)
    assert first.close_report is None or not getattr(first.close_report, "unwritten", None)
    async with HiCache.from_config(config(tmp_path)) as second:
        h = await run(second, "r", tokens + [1, 2, 3])
        assert h.hits["storage"] == 6 * PS, h.hits
        assert h.prefix_len == 6 * PS


async def test_streaming_session_turns_reuse_their_slot() -> None:
    async with HiCache.from_config(config()) as cache:
        history = prompt(8, 30)
        for turn in range(5):
            history = history + prompt(200 + turn, 9)
            h = await run(cache, f"t{turn}", history, session_id="chat")
            if turn:
                assert h.prefix_len >= len(history) - 9 - 1
            history = list(h.token_ids)
        m = cache.metrics()["sessions"]
        assert m["sessions_open"] == 1 and m["turns"] == 5
        assert m["sessions"]["chat"]["resumes"]["slot"] == 4
        # the scrape thread's view is the same figures, read without walking live dicts
        assert cache.cache.gauges() == {k: m[k] for k in cache.cache.gauges()}
        await cache.release_session("chat")
        await cache.drain()
        h = await run(cache, "after", history + [5])
        assert h.prefix_len >= (len(history) // PS) * PS - PS


async def test_abort_and_capacity_leak_nothing() -> None:
    async with HiCache.from_config(config()) as cache:
        free0 = cache.metrics()["device"]["free_tokens"]
        h = await cache.begin("x", prompt(9, 50))
        await cache.abort(h)
        await cache.abort(h)
        with pytest.raises(ValueError, match="already"):
            await cache.commit(h)
        with pytest.raises(OutOfKVSlotsError):
            await cache.begin("huge", prompt(10, 65 * PS - 1) if 65 * PS - 1 <= 2048 else prompt(10, 2048))
        assert cache.metrics()["device"]["free_tokens"] == free0
        with pytest.raises(ValueError, match="max_context_len"):
            await cache.begin("toolong", list(range(3000)))


async def test_running_out_of_request_slots_says_so() -> None:
    """With every request row (``device.max_requests``) in use, ``begin`` is refused for a row,
    not for device KV room (it said "no room for 2 tokens on device even after eviction" with
    the device nearly empty): the message names the limit; the type is still
    OutOfKVSlotsError, which servers retry. A request short of KV room is still told so."""
    cfg = config(storage={"backend": None})
    cfg["device"]["max_requests"] = 2
    async with HiCache.from_config(cfg) as cache:
        held = [await cache.begin(f"r{i}", prompt(20 + i, 2)) for i in range(2)]
        for _ in range(2):  # refused cleanly: nothing claimed, the same answer again
            with pytest.raises(OutOfKVSlotsError, match=r"request slot.*device\.max_requests") as err:
                await cache.begin("r2", prompt(22, 2))
            assert "no room for" not in str(err.value)
        await cache.abort(held.pop())
        with pytest.raises(OutOfKVSlotsError, match="no room for") as err:  # a row, but no KV room
            await cache.begin("big", prompt(23, 64 * PS))
        assert "max_requests" not in str(err.value)
        h = await run(cache, "r2", prompt(22, 2))  # a row is free again
        assert h.prefix_len == 0
        await cache.abort(held.pop())
        assert cache.metrics()["device"]["free_tokens"] == 64 * PS


async def test_decode_extend_and_chunked_commit() -> None:
    async with HiCache.from_config(config()) as cache:
        tokens = prompt(11, 33)
        h = await cache.begin("d", tokens)
        write_synthetic_kv(cache.device_pool, h.kv_indices, torch.tensor(tokens))
        for step in range(20):
            new = await cache.extend(h, [50_000 + step])
            assert new.numel() == 1
            write_synthetic_kv(cache.device_pool, new, torch.tensor([50_000 + step]))
        assert h.kv_indices.numel() == 53
        await cache.commit(h)
        h2 = await run(cache, "d2", list(h.token_ids) + [7])
        assert h2.prefix_len == 48


@pytest.mark.parametrize("pin", [False, True])
async def test_extra_host_pools_are_pinned_exactly_when_the_kv_host_pool_is(tmp_path: Path, monkeypatch, pin) -> None:
    """On a GPU machine (simulated: CUDA reported present, pinned allocations recorded, not
    made) ``host.pin_memory`` and a CPU device decide for the state pools as for the KV host
    pool: they were pinned whenever CUDA was present, locking memory the user opted out of."""
    import hicache.memory.host_alloc as host_alloc
    import hicache.memory.host_pool as host_pool
    import hicache.memory.mamba as mamba

    pinned: list[bool] = []
    real = host_alloc.alloc_host_bytes

    def record(shape, pin_memory):
        pinned.append(bool(pin_memory))
        return real(shape, False)

    monkeypatch.setattr(mamba, "alloc_host_bytes", record)
    monkeypatch.setattr(host_pool, "alloc_host_bytes", record)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = config(tmp_path)
    cfg["host"] = {**cfg.get("host", {}), "pin_memory": pin}
    cfg["extra_pools"] = [{"name": "mamba", "state_shapes": {"conv": [2, 4]}, "slots": 4, "host_slots": 8}]
    async with HiCache.from_config(cfg) as cache:
        state_host = cache.extra_pools["mamba"][1]
        assert state_host.pin_memory == cache.host_pool.pin_memory
    assert pinned and not any(pinned)  # the device is the CPU: nothing is pinned, whatever the knob


async def test_hybrid_config_registers_extra_pool(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    cfg["extra_pools"] = [{"name": "mamba", "state_shapes": {"conv": [2, 4]}, "slots": 4, "host_slots": 8}]
    async with HiCache.from_config(cfg) as cache:
        assert "mamba" in cache.extra_pools
        assert "mamba" in cache.storage.registered_pools
        await run(cache, "h", prompt(12, 20))


async def test_a_begin_refused_for_room_is_not_counted() -> None:
    """A ``begin`` that finds no device room for its new tokens is given up (the server
    retries it later): it was already counted as a request with its prompt tokens and miss
    attribution, so every retry counted again."""
    cfg = config(storage={"backend": None})
    cfg["device"]["size_tokens"] = 8 * PS
    async with HiCache.from_config(cfg) as cache:
        hold = await cache.begin("big", list(range(6 * PS)))  # 6 of the 8 pages
        for _ in range(3):
            with pytest.raises(OutOfKVSlotsError):
                await cache.begin("r", [10**6 + j for j in range(4 * PS)])
        scrape = Scrape(cache.prometheus_text())
        label = cache.metrics_label
        assert scrape.value("hicache_requests_total", cache=label) == 1.0
        assert scrape.value("hicache_prompt_tokens_total", cache=label) == 6 * PS
        misses = scrape.select("hicache_request_miss_tokens_total", cache=label)
        assert sum(s.value for s in misses) == 6 * PS  # the one request that started
        await cache.abort(hold)


async def test_restored_session_turns_are_counted_in_the_request_and_hit_totals() -> None:
    """Each turn of a streaming session is a request, its restored history a device hit: the
    scrape's request, prompt, computed and per-tier hit totals count it as the handle reports it
    (restored turns were left out: three turns of a chat counted as one request, no hit); a turn
    refused for room is not counted, as for any request."""
    async with HiCache.from_config(config(storage={"backend": None})) as cache:
        label = cache.metrics_label
        history = prompt(21, 40)
        handles = []
        for turn in range(3):
            history = history + prompt(300 + turn, 3)
            handles.append(await run(cache, f"t{turn}", history, session_id="chat"))
            history = list(handles[-1].token_ids)
        assert all(h.hits["device"] == h.prefix_len > 0 for h in handles[1:])
        free = cache.metrics()["device"]["free_tokens"]
        with pytest.raises(OutOfKVSlotsError):  # a restored turn refused for room: not counted
            await cache.begin("t3", history + prompt(400, free + PS), session_id="chat")
        scrape = Scrape(cache.prometheus_text())
        prompt_tokens = sum(len(h.token_ids) for h in handles)
        device_hits = sum(h.hits["device"] for h in handles)
        assert scrape.value("hicache_requests_total", cache=label) == 3
        assert scrape.value("hicache_prompt_tokens_total", cache=label) == prompt_tokens
        assert scrape.value("hicache_computed_tokens_total", cache=label) == prompt_tokens - device_hits
        assert scrape.value("hicache_hit_tokens_total", cache=label, tier="device") == device_hits
        assert scrape.value("hicache_request_hit_tokens_total", cache=label, tier="device") == device_hits


async def test_a_session_turn_refused_for_room_is_not_counted_as_a_resume() -> None:
    """A turn refused for device room never starts (the server retries it, up to 8 times and
    for minutes under pressure): the request totals leave it out, but the session counters
    took each refused attempt for a resumed turn (``resumes_slot``, ``restored_tokens``), so a
    conversation of 2 turns showed 4 resumes of its history, and the resume figures grew
    fastest exactly when the device was full. A turn counts once, when it starts."""
    async with HiCache.from_config(config(storage={"backend": None})) as cache:
        history = prompt(21, 40)
        for turn in range(2):
            history = history + prompt(300 + turn, 3)
            history = list((await run(cache, f"t{turn}", history, session_id="chat")).token_ids)
        keys = ("restored_tokens", "resumes_slot", "resume_tokens_slot")
        before = {k: cache.metrics()["sessions"][k] for k in keys}
        assert before["resumes_slot"] == 1
        free = cache.metrics()["device"]["free_tokens"]
        for _ in range(3):
            with pytest.raises(OutOfKVSlotsError):
                await cache.begin("t2", history + prompt(400, free + PS), session_id="chat")
        m = cache.metrics()["sessions"]
        assert {k: m[k] for k in keys} == before
        assert m["sessions"]["chat"]["resumes"]["slot"] == 1
        h = await run(cache, "t2", history + prompt(401, 3), session_id="chat")  # fits: counted once
        m = cache.metrics()["sessions"]
        assert m["resumes_slot"] == 2 and m["restored_tokens"] == before["restored_tokens"] + h.prefix_len
        # the same for a turn whose history comes back from the tree (the session offloaded)
        history = list(h.token_ids)
        assert cache.cache.offload_session("chat")
        free = cache.metrics()["device"]["free_tokens"]
        with pytest.raises(OutOfKVSlotsError):
            await cache.begin("t3", history + prompt(402, free + 2 * PS), session_id="chat")
        assert cache.metrics()["sessions"]["resumes_device"] == 0
        h = await run(cache, "t3", history + prompt(403, 3), session_id="chat")
        m = cache.metrics()["sessions"]
        assert m["resumes_device"] == 1 and m["resume_tokens_device"] == h.prefix_len > 0


async def test_a_failing_tier_change_consumer_is_counted_in_the_scrape() -> None:
    """A consumer of tier changes that raises is logged and counted by the hub (never breaks
    a tier); the count reaches the scrape (it stayed in the hub, unseen)."""
    async with HiCache.from_config(config()) as cache:
        label = cache.metrics_label

        def broken(change):  # type: ignore[no-untyped-def]
            raise RuntimeError("consumer bug")

        cache._stack.tier_changes.subscribe(broken)
        await run(cache, "a", prompt(1, 40))
        scrape = Scrape(cache.prometheus_text())
        assert (scrape.value("hicache_tier_change_subscriber_errors_total", cache=label) or 0) > 0


async def test_extra_pool_transfers_carry_the_configured_hit_policy(tmp_path: Path) -> None:
    """``extra_pools[].hit_policy`` reaches the transfers a hybrid server builds for the pool
    (it was accepted and then read by nothing)."""
    from hicache.storage.types import PoolHitPolicy

    cfg = config(tmp_path)
    pool = {"state_shapes": {"conv": [2, 4]}, "slots": 4, "host_slots": 8}
    cfg["extra_pools"] = [{"name": "mamba", "hit_policy": "trailing_pages", **pool},
                          {"name": "indexer", "hit_policy": "all_pages", **pool}]
    async with HiCache.from_config(cfg) as cache:
        mamba = cache.pool_transfer("mamba", keys=["k"])
        assert mamba.hit_policy is PoolHitPolicy.TRAILING_PAGES and mamba.keys == ["k"]
        assert cache.pool_transfer("indexer").hit_policy is PoolHitPolicy.ALL_PAGES
        with pytest.raises(KeyError, match="no extra pool"):
            cache.pool_transfer("nope")
        hit = await cache.storage.batch_exists_v2(["k"], [mamba])
        assert hit.kv_hit_pages == 0  # nothing stored: a clean miss with the transfer as built
