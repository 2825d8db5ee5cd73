"""The wire classes: vLLM's layout (batch as an array, events as tagged maps), hash mapping."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from hicache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_hash,
    decode_batch,
    encode_batch,
    to_event,
)
from hicache.keys import page_hashes
from hicache.observability import ChangeKind, Tier, TierChange


def stored(hashes: list[bytes], **kw: object) -> BlockStored:
    base = dict(block_hashes=hashes, parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None,
                medium="GPU", lora_name=None)
    base.update(kw)
    return BlockStored(**base)  # type: ignore[arg-type]


def test_layout_is_vllms_array_batch_of_tagged_maps() -> None:
    batch = KVEventBatch(ts=1.5, events=[stored([b"\x01" * 32]), BlockRemoved(block_hashes=[7], medium="CPU"),
                                         AllBlocksCleared(medium="STORAGE")], data_parallel_rank=3)
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw[0] == 1.5 and raw[2] == 3 and len(raw) == 3
    first, second, third = raw[1]
    # fields without a default are always there; defaults are left out (omit_defaults)
    assert first == {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": None,
                     "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}
    assert second == {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}
    assert third == {"type": "AllBlocksCleared", "medium": "STORAGE"}
    assert decode_batch(encode_batch(batch)) == batch


def test_bad_payloads_raise_decode_errors() -> None:
    for bad in (b"", b"\xc1", msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]), msgspec.msgpack.encode({"a": 1})):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            decode_batch(bad)


def test_page_keys_map_to_vllm_block_hashes() -> None:
    keys = page_hashes(list(range(8)), 4)
    raw = bytes.fromhex(keys[0])
    assert block_hash(keys[0]) == raw and len(raw) == 32
    assert block_hash(keys[0], "int") == int.from_bytes(raw, "big") & ((1 << 64) - 1)
    # a key of another scheme still maps to one stable 32-byte hash
    assert block_hash("not-hex") == hashlib.sha256(b"not-hex").digest() == block_hash("not-hex")
    assert block_hash("zz" * 32) == hashlib.sha256(b"zz" * 32).digest()


def test_changes_become_events_with_chained_parents() -> None:
    keys = page_hashes(list(range(12)), 4)
    ev = to_event(TierChange(ChangeKind.STORED, Tier.HOST, tuple(keys[1:]), token_ids=tuple(range(4, 12)),
                             parent_key=keys[0], page_size=4))
    assert isinstance(ev, BlockStored)
    assert ev.medium == "CPU" and ev.block_size == 4 and ev.token_ids == list(range(4, 12))
    assert ev.parent_block_hash == bytes.fromhex(keys[0]) and ev.block_hashes == [bytes.fromhex(k) for k in keys[1:]]
    ev = to_event(TierChange(ChangeKind.REMOVED, Tier.STORAGE, (keys[0],)))
    assert ev == BlockRemoved(block_hashes=[bytes.fromhex(keys[0])], medium="STORAGE")
    assert to_event(TierChange(ChangeKind.CLEARED, Tier.DEVICE)) == AllBlocksCleared(medium="GPU")
    # a reset names what device and host dropped: their removal, never a clear of every tier
    ev = to_event(TierChange(ChangeKind.CLEARED, Tier.HOST, tuple(keys[:2]), keys_complete=True))
    assert ev == BlockRemoved(block_hashes=[bytes.fromhex(k) for k in keys[:2]], medium="CPU")
    assert to_event(TierChange(ChangeKind.CLEARED, Tier.DEVICE, (), keys_complete=True)) is None
    assert to_event(TierChange(ChangeKind.REMOVED, Tier.DEVICE, ())) is None


def test_the_json_form_of_a_vllm_event_with_prompt_embeds_digests() -> None:
    """vLLM publishes each block's extra keys (LoRA name, ``(mm_identifier, offset)``, cache
    salt, and the prompt-embeds digest, 32 bytes). ``hicache events --json`` reading vLLM's
    publisher ended in a TypeError traceback ("bytes is not JSON serializable") at the first
    request with prompt embeddings; digests are hex now, as block hashes are."""
    import json

    from hicache.events.schema import event_to_dict

    digest = hashlib.sha256(b"embeds").digest()
    ev = stored([b"\x01" * 32], extra_keys=[("lora-a", ("mm-1", 4), "salt", digest), None])
    (back,) = decode_batch(encode_batch(KVEventBatch(ts=1.0, events=[ev]))).events
    out = json.loads(json.dumps(event_to_dict(back)))
    assert out["extra_keys"] == [["lora-a", ["mm-1", 4], "salt", digest.hex()], None]
    assert out["block_hashes"] == ["01" * 32]


def test_the_json_form_of_any_decodable_extra_keys() -> None:
    """``extra_keys`` holds whatever a publisher put there (vLLM's schema types it ``Any``): a
    map in it (with bytes keys or values), a msgpack extension or a timestamp decoded fine and
    then ended ``hicache events --json`` in a TypeError traceback. Each has a JSON form now:
    bytes as hex, a map as an object, anything else JSON has no form for as its text."""
    import datetime
    import json

    from hicache.events.schema import event_to_dict

    when = datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone.utc)
    extra = [[{"mm": b"\x01\x02", b"\x03": 1, 7: None}], [msgspec.msgpack.Ext(5, b"\xff"), when]]
    raw = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [b"\x01" * 32],
                                         "parent_block_hash": None, "token_ids": [1], "block_size": 1,
                                         "lora_id": None, "medium": "GPU", "lora_name": None,
                                         "extra_keys": extra}]])
    (ev,) = decode_batch(raw).events
    out = json.loads(json.dumps(event_to_dict(ev)))
    first, second = out["extra_keys"]
    assert first == [{"mm": "0102", "03": 1, "7": None}]
    assert len(second) == 2 and all(isinstance(v, str) for v in second)
