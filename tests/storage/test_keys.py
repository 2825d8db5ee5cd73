"""Page keys are byte-identical to SGLang's chained hashes; namespaces separate what must be."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from hicache.errors import ConfigError, InvalidKeyError
from hicache.keys import Namespace, page_hash, page_hashes, validate_key, validate_keys
from hicache.storage import HiCacheStorageConfig


def sglang_reference(tokens: list[int], prior: str | None) -> str:
    h = hashlib.sha256()
    if prior is not None:
        h.update(bytes.fromhex(prior))
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return h.hexdigest()


def test_page_hash_matches_reference_chain() -> None:
    tokens = list(range(100, 164))
    first = page_hash(tokens[:16])
    assert first == sglang_reference(tokens[:16], None)
    assert page_hash(tokens[16:32], first) == sglang_reference(tokens[16:32], first)
    keys = page_hashes(tokens, 16)
    assert len(keys) == 4 and keys[0] == first
    assert page_hashes(tokens + [1, 2, 3], 16) == keys  # the partial page gets no key
    assert page_hashes(torch.tensor(tokens), 16) == keys


def test_known_answer() -> None:
    # sha256 of uint32 LE [1, 2] - fixed bytes, independent of this module
    assert page_hash([1, 2]) == hashlib.sha256(b"\x01\x00\x00\x00\x02\x00\x00\x00").hexdigest()


def test_bad_tokens_rejected() -> None:
    with pytest.raises(ValueError):
        page_hash([-1])
    with pytest.raises(ValueError):
        page_hash([2**32])
    with pytest.raises(ValueError):
        page_hashes([1, 2], 0)


@pytest.mark.parametrize("bad", ["", "a\x00b", "x" * 1025, 3, None])
def test_validate_key_rejects(bad) -> None:
    with pytest.raises(InvalidKeyError):
        validate_key(bad)


def test_namespace_digest_stable_and_distinct() -> None:
    base = Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=64)
    assert base.digest == Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=64).digest
    variants = [
        Namespace(model="m2", kv_dtype="bfloat16", layout="page_first", page_size=64),
        Namespace(model="m", kv_dtype="float16", layout="page_first", page_size=64),
        Namespace(model="m", kv_dtype="bfloat16", layout="layer_first", page_size=64),
        Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=32),
        Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=64, salt="lora-a"),
        Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=64, tp_rank=1, tp_size=2),
        Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=64, revision="r2"),
    ]
    assert len({v.digest for v in variants} | {base.digest}) == len(variants) + 1
    assert Namespace.from_dict(base.to_dict()) == base
    with pytest.raises(ConfigError, match="unknown namespace field"):
        Namespace.from_dict({"modle": "x"})


def test_namespace_from_storage_config() -> None:
    cfg = HiCacheStorageConfig(tp_rank=1, tp_size=2, model_name="org/m", extra_config={"kv_dtype": "fp8", "namespace_salt": "t1"})
    ns = Namespace.from_storage_config(cfg)
    assert (ns.model, ns.tp_rank, ns.tp_size, ns.kv_dtype, ns.salt) == ("org/m", 1, 2, "fp8", "t1")
    mla = Namespace.from_storage_config(HiCacheStorageConfig(tp_rank=1, tp_size=2, is_mla_model=True, model_name="m"))
    assert (mla.tp_rank, mla.tp_size, mla.is_mla) == (0, 1, True)
    filled = ns.with_signature({"layer_num": 4, "head_num": 2, "head_dim": 8, "page_size": 16, "dtype": "torch.float16"})
    assert (filled.num_layers, filled.num_kv_heads, filled.head_dim, filled.page_size) == (4, 2, 8, 16)
    assert filled.kv_dtype == "fp8"  # known fields are not overwritten


@pytest.mark.parametrize("bad", [["ok", ""], ["ok", "a\x00b"], ["ok", "k" * 2000], ["ok", "é" * 600], ["ok", 7], ["ok", b"ok"]])
def test_validate_keys_batch_names_the_bad_key(bad) -> None:
    with pytest.raises(InvalidKeyError):
        validate_keys(bad)


def test_validate_keys_batch_accepts_and_copies() -> None:
    keys = [hashlib.sha256(bytes([i])).hexdigest() for i in range(100)] + ["é" * 10]
    got = validate_keys(keys)
    assert got == keys and got is not keys
    assert validate_keys([]) == []
    assert validate_keys(iter(["a", "b"])) == ["a", "b"]
