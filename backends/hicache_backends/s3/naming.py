"""Where a namespace and its pages live in a bucket, and how options are shown without secrets.

Layout under the configured root (``s3://bucket/prefix`` -> ``bucket/prefix``)::

    <root>/<namespace digest>/manifest.json        namespace.to_dict(), for humans and tools
    <root>/<namespace digest>/pages/<h[:2]>/<h>    one object per (key, pool)

``h`` is a hash of (pool, key), never the key text: keys are arbitrary strings (``..``, slashes,
NULs are rejected by the core but everything else is allowed) and must not be able to name an
object outside the namespace. The two-character shard keeps directory-like listings small on
fsspec filesystems that are real directories (``file://``); S3 does not care.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

__all__ = ["ObjectNames", "Redactor", "redact_options", "redact_url"]

_SECRET_WORDS = re.compile(r"key|secret|token|password|passwd|credential|auth|signature|session", re.I)
_NOT_SECRET = {"endpoint_url", "region_name", "use_ssl", "config_kwargs", "client_kwargs"}


class ObjectNames:
    """Object paths (without protocol) for one namespace under one root."""

    def __init__(self, root: str, namespace_digest: str) -> None:
        self.root = root.rstrip("/")
        self.namespace_dir = f"{self.root}/{namespace_digest}" if self.root else namespace_digest
        self.manifest = f"{self.namespace_dir}/manifest.json"
        self.pages_dir = f"{self.namespace_dir}/pages"

    @staticmethod
    def page_hash(key: str, pool: str) -> str:
        """A stable 128-bit name for (key, pool); the pool's length prefix keeps pairs unambiguous."""
        pb = pool.encode()
        h = hashlib.blake2b(digest_size=16)
        h.update(len(pb).to_bytes(2, "little"))
        h.update(pb)
        h.update(key.encode())
        return h.hexdigest()

    def page(self, key: str, pool: str) -> str:
        h = self.page_hash(key, pool)
        return f"{self.pages_dir}/{h[:2]}/{h}"

    def run_index(self, key: str, pool: str) -> str:
        """The run index of the chain whose first page is (key, pool) (see :mod:`.runs`);
        under the page prefix, so a clear removes it too (``runs`` never is a 2-char shard)."""
        h = self.page_hash(key, pool)
        return f"{self.pages_dir}/runs/{h[:2]}/{h}"


def redact_url(url: str) -> str:
    """``url`` without user info (``s3://KEY:SECRET@bucket`` must never reach a log).

    Secrets may contain ``/`` or ``@``, so everything between ``://`` and the *last* ``@`` goes
    (over-redacting a path that contains ``@`` is the safe mistake)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"


def redact_options(options: Any) -> Any:
    """A copy of ``storage_options`` with every credential-like value replaced by ``***``."""
    if isinstance(options, dict):
        out = {}
        for k, v in options.items():
            if isinstance(k, str) and k not in _NOT_SECRET and _SECRET_WORDS.search(k):
                out[k] = "***"
            else:
                out[k] = redact_options(v)
        return out
    if isinstance(options, (list, tuple)):
        return type(options)(redact_options(v) for v in options)
    if isinstance(options, str) and "://" in options:
        return redact_url(options)
    return options


class Redactor:
    """Scrubs the credential values of one store's options (and URL user info) out of text we
    log or raise - error messages of HTTP libraries may echo URLs or headers."""

    def __init__(self, options: Any, url: str = "") -> None:
        secrets: set[str] = set()
        _collect_secrets(options, secrets)
        scheme, sep, rest = url.partition("://")
        if sep and "@" in rest:
            userinfo = rest.rsplit("@", 1)[0]
            secrets.add(userinfo)
            secrets.update(userinfo.split(":", 1))
        self._secrets = sorted((s for s in secrets if len(s) >= 4), key=len, reverse=True)

    def scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return re.sub(r"(\w+://)[^/\s@]+@", r"\1***@", text)


def _collect_secrets(options: Any, out: set[str]) -> None:
    if isinstance(options, dict):
        for k, v in options.items():
            if isinstance(k, str) and k not in _NOT_SECRET and _SECRET_WORDS.search(k) and isinstance(v, str):
                out.add(v)
            else:
                _collect_secrets(v, out)
    elif isinstance(options, (list, tuple)):
        for v in options:
            _collect_secrets(v, out)
