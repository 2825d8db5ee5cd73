"""The on-medium page format shared by the file and object-store backends.

Every stored page is ``header || payload``. The header is self-describing and fixed for a given
(key, pool), so a reader that knows the page size can fetch header and payload in one read (a
``preadv`` or one ranged GET) with the payload landing straight in host-pool memory::

    offset size field
    0      4    magic b"HKVP"
    4      2    format version (1)
    6      2    header length (multiple of 64, includes padding)
    8      8    payload length in bytes
    16     8    xxh3_64 checksum of the payload
    24     16   namespace digest
    40     2    key length (UTF-8 bytes)
    42     2    pool-name length
    44     ...  key, pool name, zero padding to header length

A read is accepted only if magic, version, namespace, key, pool, length and checksum all match:
a torn, truncated, flipped, misplaced or foreign page is a miss, never returned bytes.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

from hicache.storage.segments import PageSegments

__all__ = ["MAGIC", "FORMAT_VERSION", "PageCodec", "PageHeader", "Verdict", "checksum", "checksum_stream"]

MAGIC = b"HKVP"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHHQQ16sHH")
_ALIGN = 64


_GIL_FREE_MIN = 64 * 1024


def checksum(data: memoryview | bytes | bytearray) -> int:
    """xxh3_64 of a buffer; fast enough (>10 GB/s) to verify every read.

    For large buffers the streaming object is used: its ``update`` releases the GIL, so I/O
    threads hash pages in parallel and the event loop keeps running (``xxh3_64_intdigest``
    holds the GIL for the whole pass). Both give the same digest.
    """
    if len(data) >= _GIL_FREE_MIN:
        return xxhash.xxh3_64(data).intdigest()
    return xxhash.xxh3_64_intdigest(data)


def checksum_stream() -> xxhash.xxh3_64:
    """A streaming form of :func:`checksum`: ``update`` it with the payload's pieces in order
    (a page scattered in pool memory) and ``intdigest()`` equals ``checksum`` of the whole."""
    return xxhash.xxh3_64()


class Verdict(enum.Enum):
    """Why a stored page was accepted or rejected."""

    OK = "ok"
    BAD_HEADER = "bad_header"
    WRONG_NAMESPACE = "wrong_namespace"
    WRONG_KEY = "wrong_key"
    WRONG_LENGTH = "wrong_length"
    BAD_CHECKSUM = "bad_checksum"


@dataclass(frozen=True)
class PageHeader:
    header_len: int
    payload_len: int
    checksum: int
    namespace: bytes
    key: str
    pool: str


class PageCodec:
    """Encodes and verifies page headers for one namespace."""

    def __init__(self, namespace_digest: bytes) -> None:
        if len(namespace_digest) != 16:
            raise ValueError("namespace digest must be 16 bytes")
        self.namespace_digest = namespace_digest

    @staticmethod
    def header_len(key: str, pool: str) -> int:
        raw = _FIXED.size + len(key.encode()) + len(pool.encode())
        return -(-raw // _ALIGN) * _ALIGN

    def encode(self, key: str, pool: str, payload: memoryview | bytes | PageSegments, digest: int | None = None) -> bytes:
        """The header for ``payload`` stored under (key, pool); a payload in pool pieces
        (:class:`PageSegments`, hashed as it is written) comes with its ``digest``."""
        kb, pb = key.encode(), pool.encode()
        hlen = self.header_len(key, pool)
        if digest is None:
            if isinstance(payload, PageSegments):
                raise TypeError("a payload in pool pieces is hashed as it is written: give its digest")
            digest = checksum(payload)
        fixed = _FIXED.pack(
            MAGIC, FORMAT_VERSION, hlen, len(payload), digest, self.namespace_digest, len(kb), len(pb)
        )
        return (fixed + kb + pb).ljust(hlen, b"\0")

    @staticmethod
    def parse(header: bytes | bytearray | memoryview) -> PageHeader | None:
        """Decode a header, or ``None`` if it is not one of ours."""
        if len(header) < _FIXED.size:
            return None
        magic, version, hlen, plen, digest, ns, klen, plen_name = _FIXED.unpack_from(header, 0)
        if magic != MAGIC or version != FORMAT_VERSION or hlen % _ALIGN or hlen < _FIXED.size:
            return None
        end = _FIXED.size + klen + plen_name
        if end > hlen or end > len(header):
            return None
        raw = bytes(header[_FIXED.size : end])
        try:
            key = raw[:klen].decode()
            pool = raw[klen:].decode()
        except UnicodeDecodeError:
            return None
        return PageHeader(hlen, plen, digest, bytes(ns), key, pool)

    def check(self, parsed: PageHeader, key: str, pool: str, expected_len: int | None = None) -> Verdict:
        """Check a parsed header against what the reader asked for (its payload aside): a
        reader that needs the header's fields as well parses it once and calls this."""
        if parsed.namespace != self.namespace_digest:
            return Verdict.WRONG_NAMESPACE
        if parsed.key != key or parsed.pool != pool:
            return Verdict.WRONG_KEY
        if expected_len is not None and parsed.payload_len != expected_len:
            return Verdict.WRONG_LENGTH
        return Verdict.OK

    def verify(
        self,
        header: bytes | bytearray | memoryview,
        payload: memoryview | bytes | bytearray | None,
        key: str,
        pool: str,
        expected_len: int | None = None,
    ) -> Verdict:
        """Check a header (and, when given, its payload) against what the reader asked for."""
        parsed = self.parse(header)
        if parsed is None:
            return Verdict.BAD_HEADER
        verdict = self.check(parsed, key, pool, expected_len)
        if verdict is not Verdict.OK:
            return verdict
        if payload is not None:
            if len(payload) != parsed.payload_len:
                return Verdict.WRONG_LENGTH
            if checksum(payload) != parsed.checksum:
                return Verdict.BAD_CHECKSUM
        return Verdict.OK
