"""Bad inputs to the facade's request path: each is a clear error before anything is claimed,
never tokens silently turned into others, never a failure deferred to the tree's insert or to
the close."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.facade import HiCache, token_ids_of
from test_facade import PS, config, prompt, run


def nothing_held(cache: HiCache) -> bool:
    device = cache.metrics()["device"]
    return device["free_tokens"] + device["evictable_tokens"] == device["size_tokens"] and not cache._live


@pytest.mark.parametrize("bad, error, match", [
    ([1.5] * 40, TypeError, "got 1.5"),
    (["12"] * 40, TypeError, "got '12'"),
    ("hello world", TypeError, "not str"),
    (b"hello", TypeError, "not bytes"),
    (torch.arange(40) * 1.5, TypeError, "float32"),
    (np.arange(40, dtype=np.float64), TypeError, "float64"),
    (torch.ones(40, dtype=torch.bool), TypeError, "torch.bool"),  # a mask passed for the ids
    (np.ones(40, dtype=bool), TypeError, "bool"),
    (torch.arange(40).reshape(4, 10), TypeError, "got \\[0, 1"),
    ([-1] * 40, ValueError, "-1 is outside"),
    ([2**32] * 40, ValueError, "4294967296 is outside"),
    (None, TypeError, "NoneType"),
    # unordered: a set drops repeated tokens and a dict gives its keys, both in an order that
    # is not the prompt's; before, both were taken as the prompt's tokens
    (set(range(40)), TypeError, "not set"),
    (frozenset(range(40)), TypeError, "not frozenset"),
    ({t: t for t in range(40)}, TypeError, "not dict"),
])
async def test_begin_refuses_tokens_that_are_not_uint32_ids(bad, error, match) -> None:
    async with HiCache.from_config(config()) as cache:
        with pytest.raises(error, match=match):
            await cache.begin("r", bad)
        assert nothing_held(cache)
        await run(cache, "r", prompt(1, 3 * PS))  # the id is free again


async def test_integer_arrays_and_tensors_are_token_ids() -> None:
    want = list(range(3 * PS))
    assert token_ids_of(torch.arange(3 * PS)) == want
    assert token_ids_of(np.arange(3 * PS, dtype=np.uint32)) == want
    assert token_ids_of([np.int64(t) for t in want]) == want
    assert token_ids_of(range(3 * PS)) == want
    assert token_ids_of([0, 2**32 - 1]) == [0, 2**32 - 1]


@pytest.mark.parametrize("rid, session_id, match", [
    (None, None, "rid must be a str"),
    (7, None, "rid must be a str"),
    ("r", "", "session_id must be a non-empty str"),
    ("r", 7, "session_id must be a non-empty str"),
])
async def test_begin_refuses_ids_that_are_not_strings(rid, session_id, match) -> None:
    async with HiCache.from_config(config()) as cache:
        with pytest.raises(TypeError, match=match):
            await cache.begin(rid, prompt(1, 2 * PS), session_id=session_id)
        assert nothing_held(cache)


@pytest.mark.parametrize("session_id", [None, "chat"])
async def test_extend_with_a_bad_token_changes_nothing_and_the_close_still_drains(session_id, tmp_path) -> None:
    # before: extend took -5 and 2**40 as they were; commit then failed inside the tree's insert
    # (half an insert, the request stuck), or, in a session, the close raised in the session's
    # release and never closed the controller
    async with HiCache.from_config(config(tmp_path)) as cache:
        h = await cache.begin("r", prompt(1, 2 * PS + 3), session_id=session_id)
        tokens, slots = list(h.token_ids), h.kv_indices.clone()
        for bad in ([-5] * PS, [2**40] * PS, [2.7], "abc"):
            with pytest.raises((TypeError, ValueError)):
                await cache.extend(h, bad)
            assert h.token_ids == tokens and torch.equal(h.kv_indices, slots)
        new = await cache.extend(h, [7] * PS)
        assert new.numel() == PS
        await cache.commit(h, finished=True)
    report = cache.close_report
    assert report is not None and report.drained and not report.unwritten


async def test_a_handle_of_another_cache_or_a_copy_is_refused() -> None:
    # before: cache b inserted a's slots into its own tree (KV it never wrote, slots it never
    # handed out) and its device->host backup failed on them; a copy committed twice
    import dataclasses

    async with HiCache.from_config(config()) as a, HiCache.from_config(config()) as b:
        h = await a.begin("r", prompt(1, 2 * PS + 3))
        for call in (b.commit(h), b.extend(h, [1]), b.abort(h), a.commit(dataclasses.replace(h))):
            with pytest.raises(ValueError, match="not begun by this cache"):
                await call
        assert nothing_held(b) and b.metrics()["device"]["cached_tokens"] == 0
        await a.commit(h)
        await a.drain()
        assert nothing_held(a)


def test_an_iterator_of_token_ids_is_read_once_and_a_bad_one_named() -> None:
    assert token_ids_of(iter([1, 2, 3])) == [1, 2, 3]
    with pytest.raises(ValueError, match="-7 is outside"):
        token_ids_of(t for t in (1, -7, 3))
    with pytest.raises(TypeError, match="not int"):
        token_ids_of(5)


@pytest.mark.parametrize("source", ["configs/default.toml", "__dict__", None])
def test_a_config_that_is_no_hicacheconfig_is_refused_with_the_way_to_build_one(source) -> None:
    """``HiCache(...)`` takes a loaded :class:`HiCacheConfig`; a path or a dict (what
    ``from_config`` takes) failed with ``AttributeError: 'dict' object has no attribute
    'model'``, which named neither the mistake nor the fix."""
    if source == "__dict__":
        source = config()
    with pytest.raises(TypeError, match=r"HiCacheConfig.*HiCache\.from_config"):
        HiCache(source)  # type: ignore[arg-type]
