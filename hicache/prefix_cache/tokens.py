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

__all__ = ["TokenRun", "empty_run", "pack_tokens"]

#: a packed run of token ids (typecode ``'I'``, or ``'q'`` for ids outside uint32)
TokenRun = array


def empty_run() -> TokenRun:
    """An empty key (the root's)."""
    return array("I")


def pack_tokens(tokens: Sequence[int]) -> TokenRun:
    """``tokens`` as a new packed run (the caller's sequence is not kept)."""
    try:
        return array("I", tokens)
    except OverflowError:
        pass
    except TypeError as exc:
        raise ValueError(f"token ids must be integers ({exc})") from None
    try:
        return array("q", tokens)
    except OverflowError as exc:
        raise ValueError(f"token ids must fit in int64 ({exc})") from None
