"""Page keys and namespaces.

A page key is a chained hash that encodes the whole prefix up to and including the page, so "the
longest run of existing keys from the start" is exactly the prefix hit. The hash is
byte-identical to SGLang's::

    digest_0 = sha256(tokens_0 as uint32 little-endian)
    digest_i = sha256(digest_{i-1} (32 raw bytes) || tokens_i as uint32 little-endian)
    key_i    = digest_i.hex()

Keys alone ignore everything that makes two pages of the same tokens incompatible (model
revision, KV dtype, layout, page size, head/layer geometry, parallel rank, LoRA/tenant). A
:class:`Namespace` captures those; backends store each namespace apart, so two namespaces never
read each other's pages.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, TypeGuard

from hicache.errors import ConfigError, InvalidKeyError

if TYPE_CHECKING:
    from hicache.storage.types import HiCacheStorageConfig

__all__ = [
    "MAX_KEY_BYTES",
    "Namespace",
    "page_hash",
    "page_hashes",
    "validate_key",
]

MAX_KEY_BYTES = 1024
_UINT32_MAX = 0xFFFFFFFF


def _token_bytes(tokens: Sequence[int] | Any) -> bytes:
    """Tokens as uint32 little-endian bytes, accepting lists, numpy arrays and torch tensors."""
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    out = bytearray(4 * len(tokens))
    for i, t in enumerate(tokens):
        t = int(t)
        if t < 0 or t > _UINT32_MAX:
            raise ValueError(f"token id {t} does not fit in uint32")
        out[4 * i : 4 * i + 4] = t.to_bytes(4, "little")
    return bytes(out)


def page_hash(tokens: Sequence[int], prior_hash: str | None = None) -> str:
    """Hash of one page of tokens chained to the previous page's hash (hex) or to nothing."""
    h = hashlib.sha256()
    if prior_hash is not None:
        h.update(bytes.fromhex(prior_hash))
    h.update(_token_bytes(tokens))
    return h.hexdigest()


def page_hashes(
    tokens: Sequence[int], page_size: int, prior_hash: str | None = None
) -> list[str]:
    """Chained keys of every *full* page of ``tokens`` (a trailing partial page gets no key)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    keys: list[str] = []
    prev = prior_hash
    for start in range(0, len(tokens) - page_size + 1, page_size):
        prev = page_hash(tokens[start : start + page_size], prev)
        keys.append(prev)
    return keys


def validate_key(key: object) -> str:
    """Return ``key`` if a backend may store it; raise :class:`InvalidKeyError` otherwise.

    Backends never build paths from keys (they hash them), so the rules only exclude what no
    medium can hold faithfully: non-strings, the empty string, NUL bytes and keys over
    ``MAX_KEY_BYTES`` UTF-8 bytes.
    """
    if not isinstance(key, str):
        raise InvalidKeyError(f"page key must be str, got {type(key).__name__}: {key!r:.80}")
    return validate_text(key, "page key", MAX_KEY_BYTES)


def validate_text(value: str, what: str, max_bytes: int) -> str:
    """``value`` if it is non-empty UTF-8 text without NUL of at most ``max_bytes`` bytes (what
    a page header can carry), else :class:`InvalidKeyError` naming ``what``."""
    if not value:
        raise InvalidKeyError(f"{what} must not be empty")
    if "\x00" in value:
        raise InvalidKeyError(f"{what} must not contain NUL: {value!r:.80}")
    try:
        n = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidKeyError(f"{what} is not valid UTF-8 text: {value!r:.80}") from exc
    if n > max_bytes:
        raise InvalidKeyError(f"{what} is {n} bytes long; the limit is {max_bytes}")
    return value


def validate_keys(keys: Iterable[object]) -> list[str]:
    """Validate every key of a batch (see :func:`validate_key`); returns them as a new list.

    Why a batch path: every page a tree writes to storage is checked, on the event loop (the
    controller's job check) and again on the backend's thread, one Python call per key (1-1.5
    us a key, 15% of the loop time of the tiered radix benchmark). Keys the tree makes are hex
    digests, so the whole batch is checked at once in C (joined, ASCII, no NUL, lengths in
    range); only a batch that fails that is checked key by key, for the error naming the key."""
    if isinstance(keys, (str, bytes)):
        raise InvalidKeyError("expected a list of keys, got a single string")
    out = list(keys)
    if _short_ascii_texts(out):
        return out
    return [validate_key(k) for k in out]


def _short_ascii_texts(keys: list[object]) -> TypeGuard[list[str]]:
    """Whether every item is non-empty ASCII text without NUL of at most ``MAX_KEY_BYTES``
    (ASCII: a character is a byte). ``False`` says nothing about which key is bad."""
    if not keys:
        return True
    try:
        joined = "".join(keys)  # type: ignore[arg-type] # a TypeError for anything not str
    except TypeError:
        return False
    if not joined.isascii() or "\x00" in joined:
        return False
    lengths = list(map(len, keys))  # type: ignore[arg-type]
    return min(lengths) > 0 and max(lengths) <= MAX_KEY_BYTES


@dataclass(frozen=True, kw_only=True)
class Namespace:
    """Everything that makes KV pages of the same tokens incompatible.

    Two stores (or two processes) share pages only when their namespaces are equal. Fields left
    at ``None`` are unknown and simply take part in the digest as such; fill in what you know.
    """

    model: str = ""
    revision: str | None = None
    kv_dtype: str | None = None
    layout: str | None = None
    page_size: int | None = None
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    is_mla: bool = False
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    salt: str | None = None
    extra: tuple[tuple[str, str], ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description; this is what a backend writes as its manifest."""
        d = asdict(self)
        d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Namespace:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown namespace field(s) {unknown}; allowed: {sorted(known)}"
            )
        data = dict(data)
        if "extra" in data:
            data["extra"] = tuple(sorted((str(k), str(v)) for k, v in dict(data["extra"]).items()))
        return cls(**data)

    @functools.cached_property
    def digest(self) -> str:
        """A stable 32-hex-digit id of this namespace (same in every process and Python).

        Cached: backends ask for it once per page, and the namespace is immutable."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    @functools.cached_property
    def digest_bytes(self) -> bytes:
        return bytes.fromhex(self.digest)

    def with_signature(self, signature: dict[str, Any]) -> Namespace:
        """Fill unknown geometry fields from a host pool's ``storage_signature()``."""
        mapping = {
            "dtype": "kv_dtype",
            "kv_dtype": "kv_dtype",
            "page_size": "page_size",
            "layer_num": "num_layers",
            "num_layers": "num_layers",
            "head_num": "num_kv_heads",
            "num_kv_heads": "num_kv_heads",
            "head_dim": "head_dim",
            "layout": "layout",
        }
        updates: dict[str, Any] = {}
        for src, dst in mapping.items():
            if src in signature and getattr(self, dst) is None and dst not in updates:
                value = signature[src]
                updates[dst] = str(value) if dst in ("kv_dtype", "layout") else int(value)
        if not updates:
            return self
        d = self.to_dict()
        d.update(updates)
        return Namespace.from_dict(d)

    def with_pool_format(self, pool: str, tag: str) -> Namespace:
        """This namespace for pages of ``pool`` stored in the pool's own byte format ``tag``
        (see :func:`hicache.storage.pool_format.pool_format_tag`): unchanged when it already
        says so (an engine integration that put the format in: its KV format as ``layout``,
        another pool's as ``extra["pool.<name>"]``)."""
        extra = dict(self.extra)
        named = {v for k, v in extra.items() if k.startswith("pool.")}
        if tag in named or (pool == "kv" and self.layout == tag):
            # the format is in already, maybe under the engine's own name for the pool (the
            # SGLang integration stores a pool split over TP ranks under a name per rank: each
            # rank adding its own entry split their namespaces, and every rank but the writer
            # missed the KV)
            return self
        extra[f"pool.{pool}"] = tag
        return replace(self, extra=tuple(sorted(extra.items())))

    @classmethod
    def from_storage_config(
        cls, config: HiCacheStorageConfig | None, **overrides: Any
    ) -> Namespace:
        """Build a namespace from SGLang's storage config.

        ``config.extra_config`` may carry ``model_revision``, ``kv_dtype``, ``layout``,
        ``page_size``, ``num_layers``, ``num_kv_heads``, ``head_dim`` and ``namespace_salt``.
        MLA models share pages across TP ranks (the latent is not split by head), as in SGLang.
        """
        if config is None:
            return cls(**overrides)
        extra = dict(config.extra_config or {})
        is_mla = bool(config.is_mla_model)
        values: dict[str, Any] = dict(
            model=config.model_name or "",
            revision=extra.get("model_revision"),
            kv_dtype=extra.get("kv_dtype"),
            layout=extra.get("layout")
            or ("page_first" if config.is_page_first_layout else None),
            page_size=extra.get("page_size"),
            num_layers=extra.get("num_layers"),
            num_kv_heads=extra.get("num_kv_heads"),
            head_dim=extra.get("head_dim"),
            is_mla=is_mla,
            tp_rank=0 if is_mla else int(config.tp_rank),
            tp_size=1 if is_mla else int(config.tp_size),
            pp_rank=int(config.pp_rank),
            pp_size=int(config.pp_size),
            salt=extra.get("namespace_salt"),
        )
        values.update(overrides)
        return cls(**values)
