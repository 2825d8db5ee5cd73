"""Where things live inside a ``file`` store root, and the small footer each page file carries.

A root holds one directory per namespace, named by the namespace digest, so stores that must
never share pages (another model, dtype, layout, page size, TP rank...) never even share a
folder::

    <root>/
      <namespace digest>/             32 hex digits
        manifest.json                 Namespace.to_dict() as JSON (what made these pages)
        pages/00/ ... pages/ff/       256 hashed subfolders, each created by its first write
          <page id>.page              header || payload || footer
          .<page id>.<pid>.<n>.tmp    a write in progress (renamed over the .page when done)

A page id is a keyed BLAKE2b of ``(pool, key)``, so no key text ever reaches a path: a key such
as ``../../etc/passwd`` is just bytes to hash. One level of 256 folders keeps every directory
small (ext4 handles 10^5 entries per folder without trouble, i.e. ~25M pages per namespace)
while a full scan at open costs only 256 ``scandir`` calls.

The footer records the page's *parent* (the page before it in its prefix chain) so that
leaf-first eviction still knows the tree after a restart. It lives inside the page file and is
published by the same ``os.replace``, so page and relation can never disagree. Its own xxh3
check means a damaged footer makes the whole page corrupt, exactly like a damaged payload.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from dataclasses import dataclass

import xxhash

from hicache.storage.page_format import PageCodec
from hicache_backends.writers import MACHINE_HEX, parse_machine

__all__ = [
    "FOOTER_LEN",
    "PAGE_SUFFIX",
    "TMP_SUFFIX",
    "Footer",
    "NamespaceLayout",
    "decode_footer",
    "encode_footer",
    "page_id",
    "parse_manifest_tmp_name",
    "parse_tmp_name",
]

PAGE_SUFFIX = ".page"
TMP_SUFFIX = ".tmp"
MANIFEST_NAME = "manifest.json"
_MANIFEST_TMP_PREFIX = MANIFEST_NAME + "."
FANOUT = 256
ID_LEN = 16  # bytes; 32 hex digits

_FOOTER = struct.Struct("<4sHH16sQ")  # magic, version, flags, parent id, xxh3 of the first 24 bytes
FOOTER_LEN = _FOOTER.size  # 32
_FOOTER_MAGIC = b"HKVF"
_FOOTER_VERSION = 1
_HAS_PARENT = 1
_ID_PERSON = b"hicache-file"


@functools.lru_cache(maxsize=1 << 14)
def page_id(key: str, pool: str) -> str:
    """The 32-hex-digit id (and file stem) of page ``(key, pool)``.

    The pool name is length-prefixed so ``("a", "b.c")`` and ``("a.b", "c")`` cannot meet.
    Remembered for the last 16k pages (~3 MiB): a batch asks for each page's id more than
    once (a lookup then its read; a write's pages and their parents, which are the page
    before), and the hash costs more than the lookup.
    """
    pb = pool.encode()
    h = hashlib.blake2b(digest_size=ID_LEN, person=_ID_PERSON)
    h.update(len(pb).to_bytes(2, "little"))
    h.update(pb)
    h.update(key.encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Footer:
    """What a page file records after its payload."""

    parent: str | None


def encode_footer(parent: str | None) -> bytes:
    """The 32-byte footer naming ``parent`` (a page id) or no parent."""
    raw = bytes.fromhex(parent) if parent else bytes(ID_LEN)
    head = _FOOTER.pack(_FOOTER_MAGIC, _FOOTER_VERSION, _HAS_PARENT if parent else 0, raw, 0)[:24]
    return head + xxhash.xxh3_64_intdigest(head).to_bytes(8, "little")


def decode_footer(data: bytes | bytearray | memoryview) -> Footer | None:
    """The footer in ``data`` (exactly ``FOOTER_LEN`` bytes), or ``None`` if it is damaged."""
    if len(data) != FOOTER_LEN:
        return None
    magic, version, flags, raw, check = _FOOTER.unpack(data)
    if magic != _FOOTER_MAGIC or version != _FOOTER_VERSION:
        return None
    if xxhash.xxh3_64_intdigest(bytes(data[:24])) != check:
        return None
    return Footer(raw.hex() if flags & _HAS_PARENT else None)


def parse_tmp_name(name: str) -> tuple[int, int | None] | None:
    """The writer's pid and machine (see :mod:`hicache_backends.writers`; ``None`` in names
    from before it was written there) of a page's temporary file name
    (``.<page>.<pid>.<serial>[.<machine>].tmp``), or ``None`` if ``name`` is not one of ours."""
    if not (name.startswith(".") and name.endswith(TMP_SUFFIX)):
        return None
    return _writer_of(name[1 : -len(TMP_SUFFIX)].split(".")[1:])


def parse_manifest_tmp_name(name: str) -> tuple[int, int | None] | None:
    """The writer's pid and machine of the manifest's temporary file name
    (``manifest.json.<pid>.<serial>[.<machine>].tmp``), as :func:`parse_tmp_name` reads a page's."""
    if not (name.startswith(_MANIFEST_TMP_PREFIX) and name.endswith(TMP_SUFFIX)):
        return None
    return _writer_of(name[len(_MANIFEST_TMP_PREFIX) : -len(TMP_SUFFIX)].split("."))


def _writer_of(fields: list[str]) -> tuple[int, int | None] | None:
    """A temporary name's writer fields, ``pid``, ``serial`` and (written since) ``machine``,
    as ``(pid, machine)``; ``None`` when they are not ours."""
    if len(fields) not in (2, 3) or not fields[0].isdigit():
        return None
    machine = None
    if len(fields) == 3:
        machine = parse_machine(fields[2])
        if machine is None:
            return None
    return int(fields[0]), machine


class NamespaceLayout:
    """Paths of one namespace inside one root. Pure computation: no I/O happens here."""

    def __init__(self, root: str, digest: str) -> None:
        self.root = os.path.abspath(root)
        self.digest = digest
        self.ns_dir = os.path.join(self.root, digest)
        self.pages_dir = os.path.join(self.ns_dir, "pages")
        self.manifest_path = os.path.join(self.ns_dir, MANIFEST_NAME)
        self.subdirs = [os.path.join(self.pages_dir, f"{i:02x}") for i in range(FANOUT)]

    def subdir(self, pid: str) -> str:
        return os.path.join(self.pages_dir, pid[:2])

    def path(self, pid: str) -> str:
        return os.path.join(self.pages_dir, pid[:2], pid + PAGE_SUFFIX)

    def tmp_path(self, pid: str, serial: int) -> str:
        """A temporary name in the page's own folder (``os.replace`` must not cross devices),
        naming its writer: pid and machine, so that only a process of the same machine and
        PID namespace judges the writer dead by its pid (a container that shares the root
        has pids of its own)."""
        return os.path.join(self.pages_dir, pid[:2], f".{pid}.{os.getpid()}.{serial}.{MACHINE_HEX}{TMP_SUFFIX}")

    def manifest_tmp_path(self, serial: int) -> str:
        """The manifest's temporary name, naming its writer as :meth:`tmp_path` does (so a
        sweep can tell a killed writer's, :func:`parse_manifest_tmp_name`)."""
        return f"{self.manifest_path}.{os.getpid()}.{serial}.{MACHINE_HEX}{TMP_SUFFIX}"

    @staticmethod
    def header_len(key: str, pool: str) -> int:
        return PageCodec.header_len(key, pool)

    @staticmethod
    def file_size(key: str, pool: str, payload_len: int) -> int:
        """Bytes a page of ``payload_len`` takes on disk (what capacity counts)."""
        return PageCodec.header_len(key, pool) + payload_len + FOOTER_LEN
