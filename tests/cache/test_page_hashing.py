"""Page keys: the native chain (``_pagehash``), the hashlib fallback and the reference
``hicache.keys.page_hashes`` give the same keys, and bad input is a clear error on every path."""

from __future__ import annotations

import random
import threading
from array import array

import pytest

from hicache.keys import page_hashes
from hicache.prefix_cache import hashing
from hicache.prefix_cache.hashing import NATIVE_HASHING, fast_page_hashes, namespace_seed
from hicache.testing.fresh_python import python_says

needs_native = pytest.mark.skipif(not NATIVE_HASHING, reason="hicache.prefix_cache._pagehash is not built")


@pytest.fixture(params=["native", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test through the C chain and through the hashlib fallback."""
    if request.param == "native" and not NATIVE_HASHING:
        pytest.skip("hicache.prefix_cache._pagehash is not built")
    if request.param == "python":
        monkeypatch.setattr(hashing, "_native_chain_hex", None)
    return str(request.param)


def _random_prior(rng: random.Random) -> str | None:
    return rng.choice([None, rng.randbytes(32).hex(), namespace_seed("model-a"), rng.randbytes(5).hex(), ""])


def test_keys_match_the_reference_on_random_input(path: str) -> None:
    rng = random.Random(7)
    for _ in range(200):
        page = rng.choice([1, 2, 3, 16, 63, 64, 256])
        tokens = [rng.randrange(0, 1 << 32) for _ in range(rng.randrange(0, 1500))]
        prior = _random_prior(rng)
        assert fast_page_hashes(tokens, page, prior) == page_hashes(tokens, page, prior)


def test_packed_keys_and_lists_give_the_same_keys(path: str) -> None:
    tokens = list(range(1000, 1000 + 64 * 5 + 7))
    assert fast_page_hashes(array("I", tokens), 64) == fast_page_hashes(tokens, 64) == page_hashes(tokens, 64)


def test_a_long_batch_hashed_without_the_gil_matches(path: str) -> None:
    # 48k tokens = 192 KiB: past the size at which the native chain releases the GIL
    rng = random.Random(3)
    tokens = array("I", (rng.randrange(0, 1 << 32) for _ in range(48 * 1024)))
    prior = rng.randbytes(32).hex()
    assert fast_page_hashes(tokens, 64, prior) == page_hashes(list(tokens), 64, prior)


def test_threads_hashing_at_once_each_get_their_own_keys(path: str) -> None:
    batches = [array("I", range(i * 100_000, i * 100_000 + 32 * 1024)) for i in range(4)]
    expected = [page_hashes(list(b), 32) for b in batches]
    got: list[list[str] | None] = [None] * len(batches)

    def work(i: int) -> None:
        for _ in range(5):
            got[i] = fast_page_hashes(batches[i], 32)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected


def test_no_full_page_gives_no_key(path: str) -> None:
    assert fast_page_hashes([], 4) == []
    assert fast_page_hashes([1, 2, 3], 4) == []
    assert fast_page_hashes([1, 2, 3, 4, 5], 4) == page_hashes([1, 2, 3, 4], 4)


@pytest.mark.parametrize("tokens", [[1, -1, 2, 3], [1, 1 << 32, 2, 3], [1, 2.5, 3, 4], [1, "2", 3, 4]])
def test_tokens_that_are_not_uint32_are_a_value_error(path: str, tokens: list[object]) -> None:
    with pytest.raises(ValueError):
        fast_page_hashes(tokens, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize("page", [0, -64])
def test_a_page_size_below_one_is_a_value_error(path: str, page: int) -> None:
    with pytest.raises(ValueError, match="page_size"):
        fast_page_hashes([1, 2, 3, 4], page)


def test_a_prior_that_is_not_hex_is_a_value_error(path: str) -> None:
    with pytest.raises(ValueError):
        fast_page_hashes([1, 2, 3, 4], 4, "not hex")


@needs_native
def test_the_native_chain_checks_its_arguments() -> None:
    from hicache.prefix_cache._pagehash import chain_hex

    assert chain_hex(b"", 4) == []
    assert chain_hex(bytes(8), 4) == page_hashes([0, 0], 1)
    with pytest.raises(ValueError, match="whole number"):
        chain_hex(bytes(10), 4)
    with pytest.raises(ValueError, match="positive"):
        chain_hex(bytes(8), 0)
    with pytest.raises(TypeError):
        chain_hex("text", 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        chain_hex(bytes(8), 4, "prior as text")  # type: ignore[arg-type]
    # any buffer: bytearray, memoryview, array; the prior too
    prior = bytes(range(32))
    want = page_hashes([7, 8], 1, prior.hex())
    assert chain_hex(bytearray(array("I", [7, 8]).tobytes()), 4, memoryview(prior)) == want
    assert chain_hex(array("I", [7, 8]), 4, bytearray(prior)) == want


def test_without_the_extension_the_module_falls_back_to_hashlib() -> None:
    # a fresh interpreter in which the extension cannot be imported (as where it is not built)
    code = (
        "import sys; sys.modules['hicache.prefix_cache._pagehash'] = None\n"
        "from hicache.prefix_cache import hashing\n"
        "from hicache.keys import page_hashes\n"
        "assert not hashing.NATIVE_HASHING\n"
        "toks = list(range(1, 1 + 64 * 3))\n"
        "assert hashing.fast_page_hashes(toks, 64, 'ab' * 32) == page_hashes(toks, 64, 'ab' * 32)\n"
        "print('fallback ok')\n"
    )
    assert "fallback ok" in python_says(code)
