"""Run indexes: one small object per written chain of pages, so a prefix lookup costs one GET.

Why: a lookup asks whether the pages of a prompt exist, in chain order, and only the leading
run matters. One HEAD per page at 32 in flight is 16 round trips for a 512-page prompt (800 ms
at 50 ms a request). A write batch of the tree is a chain (each page's parent is the page
before it), so after its pages are stored the writer also stores the batch's page names under
the name of its first page. A lookup that starts where a batch started then learns the whole
batch in one GET, alongside the HEADs it sends for the pages right after (the fallback when no
index exists, e.g. for pages written by an older version).

An index only says what was written; like a HEAD it can be stale (a page deleted since, by a
lifecycle rule, another process's clear, or a ``batch_delete`` of pages after the chain's first:
nothing rewrites the index; a ``batch_delete`` of the first page removes the index with it, and
a lookup trusts an index only past a wave of HEADs that all found their pages), and a lookup
then claims that page once. The read of it is a clean miss (a zeroed pool page,
never an exception or foreign bytes; a ``stale_hits`` where the exists cache still held the
claim), and the page is marked gone, so this process's lookups stop there from then on, the
index notwithstanding (:mod:`.cache`).
Indexes live under the namespace's page prefix, so ``clear`` removes them with the pages; an
index that does not parse is ignored.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

__all__ = ["MAX_BYTES", "MAX_RUN", "MIN_RUN", "decode_run", "encode_run"]

#: Shorter chains gain nothing over the HEADs sent alongside.
MIN_RUN = 2
#: Page names per index (16 bytes of hex each): bounds what a lookup downloads and parses.
MAX_RUN = 8192
#: The largest body that may be an index: a lookup reads no more of the object (anything
#: larger, a foreign object at an index's name, is no index of ours).
MAX_BYTES = 64 * MAX_RUN
_VERSION = 1


def encode_run(names: Sequence[str]) -> bytes:
    """The index body for the page names of one chain, in order."""
    return json.dumps({"v": _VERSION, "pages": list(names[:MAX_RUN])}, separators=(",", ":")).encode()


def decode_run(data: bytes | None) -> list[str] | None:
    """The page names of an index body; ``None`` for anything that is not one of ours."""
    if not data or len(data) > MAX_BYTES:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("v") != _VERSION:
        return None
    pages = doc.get("pages")
    if not isinstance(pages, list) or not all(isinstance(p, str) for p in pages):
        return None
    return pages[:MAX_RUN]
