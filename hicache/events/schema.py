"""KV events in vLLM's wire schema, so routers that read vLLM's events read ours unchanged.

Why our own classes rather than vLLM's: the core never imports an engine. These msgspec Structs
have the names, tags and layout of ``vllm/distributed/kv_events.py`` (vLLM 0.32): a batch is an
*array* ``[ts, events, data_parallel_rank]``; an event is a *map* tagged ``{"type":
"BlockStored", ...}``, with fields at their default left out. A consumer decoding with
``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)`` gets vLLM's own objects
(``tests/engines/vllm/test_kv_events_wire.py`` proves it).

Mediums: ``GPU`` for device pages, ``CPU`` for host pages, ``STORAGE`` for any storage backend
(vLLM's constants). Our :class:`AllBlocksCleared` carries a ``medium`` (which tier was cleared);
vLLM's class has no fields and ignores it, so a vLLM consumer clears everything it knows of the
replica - a safe over-clear (it routes less by cache, never to a prefix that is gone). It is
sent only for a clear that cannot name its pages (a store's that cannot list them); a reset of
device and host, and a store's clear that names its pages, is their ``BlockRemoved``
(:func:`~hicache.events.convert.to_event`).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "event_to_dict",
]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

#: vLLM's ``ExternalBlockHash``: 32 sha256 bytes, or their low 64 bits as an int
BlockHash = bytes | int


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: a map tagged with the class name under ``type`` (vLLM's layout)."""


class BlockStored(_Event):
    """Pages a tier now holds, in prefix order; ``parent_block_hash`` is the page before the
    first one (``None`` at the start of a prompt)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    """Pages a tier no longer holds."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    """Every page of ``medium`` is gone (``None``: of every tier)."""

    medium: str | None = None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Events published together: ``ts`` is ``time.time()`` at publication."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack bytes of ``batch`` (what the publisher sends as the payload frame)."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload; raises ``msgspec.DecodeError``/``ValidationError`` on bad bytes."""
    return _decoder.decode(payload)


def event_to_dict(event: KVEvent) -> dict[str, Any]:
    """A JSON-friendly dict of one event (hashes and other bytes as hex), for ``hicache events --json``."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if name in ("block_hashes",):
            value = [_hash_text(h) for h in value]
        elif name == "parent_block_hash":
            value = None if value is None else _hash_text(value)
        elif name == "extra_keys":  # vLLM's prompt-embeds digests are bytes
            value = _plain(value)
        out[name] = value
    return out


def _hash_text(h: BlockHash) -> str | int:
    return h.hex() if isinstance(h, bytes) else h


def _plain(value: Any) -> Any:
    """``value`` with every ``bytes`` in it as hex, tuples as lists, maps as objects (their
    keys as text) and anything else JSON has no form for (a msgpack extension, a timestamp) as
    its text: what JSON can write, whatever a publisher put in a field typed ``Any``."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(_plain(k)): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, str | int | float):
        return value
    return str(value)
