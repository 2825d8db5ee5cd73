"""Token runs of tree keys, packed into C arrays.

Why: a node's key is compared with a request's tokens on every walk of every request. As
Python lists, each comparison dereferences two int objects per token, scattered over the heap
(35 ns a token in the radix benchmark's profile, most of the tree's time), and every key holds
8 bytes of pointers per token on top of the int objects. Packed as ``array('I')`` (4 bytes a
token) a comparison is a C loop over contiguous memory, a node key takes half the memory of a
list, and a request is converted once (5 ns a token) where it is compared or stored.

Token ids are vocabulary indices, so they fit in uint32; a run with a negative or wider id is
packed as int64 (``'q'``) instead: still exact, only slower to compare against ``'I'`` runs.
Anything that is not an integer is a ``ValueError`` naming the problem.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    from hicache.prefix_cache.types import RadixKey

__all__ = ["TokenRun", "empty_run", "is_packed", "key_run", "pack_tokens", "page_key"]

#: a packed run of token ids (typecode ``'I'``, or ``'q'`` for ids outside uint32)
TokenRun = array


def empty_run() -> TokenRun:
    """An empty key (the root's)."""
    return array("I")


def pack_tokens(tokens: Sequence[int]) -> TokenRun:
    """``tokens`` as a new packed run (the caller's sequence is not kept).

    A list goes through ``array.fromlist``, which converts 1.5-1.8x faster than the
    ``array('I', list)`` constructor (measured on 16k tokens: 3-4 against 5.5-6 ns a token);
    on a bad id it leaves the array empty and raises, so the fallback below sees the same
    errors either way."""
    try:
        if type(tokens) is list:
            run = array("I")
            run.fromlist(tokens)
            return run
        return array("I", tokens)
    except OverflowError:
        pass
    except TypeError as exc:
        raise ValueError(f"token ids must be integers ({exc})") from None
    try:
        return array("q", tokens)
    except OverflowError as exc:
        raise ValueError(f"token ids must fit in int64 ({exc})") from None


def page_key(page: Sequence[int]) -> bytes | tuple[int, ...]:
    """The dict key of a page of tokens among a node's children: its uint32 bytes.

    Why bytes: every step of every walk looks a child up by its first page. A tuple of 64
    token ids is 64 int objects to make, hash and compare (about 4 us a lookup from a packed
    run); the page's bytes are one object hashed by one C loop (about 0.6 us). The key is
    canonical, so a list, an ``'I'`` run and a ``'q'`` run of the same ids give the same key:
    a page whose ids all fit in uint32 is always its uint32 bytes, any other page of integers
    a tuple of its ids. A non-integer id is the ``ValueError`` :func:`pack_tokens` gives, on a
    match as on an insert.
    """
    if type(page) is TokenRun and page.typecode == "I":
        return page.tobytes()
    try:
        return array("I", page).tobytes()
    except OverflowError:
        return tuple(page)
    except TypeError as exc:
        raise ValueError(f"token ids must be integers ({exc})") from None


def key_run(key: RadixKey, end: int) -> TokenRun:
    """The first ``end`` (at least) tokens of ``key``, packed; a ``'I'`` key is its own run, a
    ``'q'`` key is repacked once as ``'I'`` when its ids fit (its nodes then hash as storage keys).

    A list key is packed once and the run kept on the key: a request's key is walked by its
    match and again by its insert, and converting the list is most of what either costs when
    the tree itself is fast (packed keys walk 4-5x faster than list keys in the radix
    benchmark). The kept run is reused only while the key holds the same list at the same
    length."""
    ids = key.token_ids
    if is_packed(ids):
        return ids
    kept = key._run
    if kept is not None and kept[0] is ids and kept[1] == len(ids) and len(kept[2]) >= end:
        return kept[2]
    run = pack_tokens(ids if len(ids) == end else ids[:end])  # a 'q' run too: 'I' when its ids fit
    key._run = (ids, len(ids), run)
    return run


def is_packed(tokens: object) -> TypeGuard[TokenRun]:
    """Whether ``tokens`` is a uint32 run already (walked and stored as it is)."""
    return type(tokens) is TokenRun and tokens.typecode == "I"
