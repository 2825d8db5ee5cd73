"""The demo server's wire format: parsing and validating ``POST /v1/generate`` bodies.

Kept apart from the handlers so the rules (what a prompt may be, how long, which flags exist)
are in one place and testable without HTTP. A bad request raises :class:`RequestError`, which
the app turns into a 400 whose message names the field.

Body::

    {"tokens": [int, ...]  |  "prompt": "text",   # text maps to its UTF-8 bytes (token = byte)
     "max_new_tokens": int,                        # default: server.max_new_tokens
     "session_id": str, "end_session": bool,       # multi-turn sessions (optional)
     "stream": bool,                               # NDJSON, one line per token, then a summary
     "debug_reference": bool,                      # also return the no-cache recompute
     "rid": str}                                   # request id (default: generated)
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from hicache.errors import HiCacheError, quoted

__all__ = ["GenerateRequest", "RequestError", "decode_generate", "parse_generate", "text_of_tokens", "tokens_of_text"]

_KNOWN = {"tokens", "prompt", "max_new_tokens", "session_id", "end_session", "stream", "debug_reference", "rid"}



class RequestError(HiCacheError, ValueError):
    """A request body the server cannot accept; the message is safe to return to the client."""


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    rid: str
    tokens: list[int]
    max_new_tokens: int
    session_id: str | None = None
    end_session: bool = False
    stream: bool = False
    debug_reference: bool = False
    from_text: bool = False


def tokens_of_text(text: str) -> list[int]:
    """The byte-level "tokenizer": one token per UTF-8 byte. Text that has no UTF-8 form (a
    lone surrogate, which JSON's ``\\ud800`` escapes can carry) is a :class:`RequestError`."""
    try:
        return list(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise RequestError(f"prompt is not valid Unicode text ({exc.reason} at character {exc.start})") from None


def decode_generate(
    raw: bytes, *, vocab_size: int, max_context_len: int, default_max_new_tokens: int
) -> GenerateRequest:
    """Decode and validate a raw body. Every way JSON can be hostile - invalid UTF-8, bad
    syntax, integers past Python's digit limit, nesting deeper than the recursion limit - is a
    :class:`RequestError`, never an exception a handler would turn into a 500."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise RequestError("the body is not valid JSON") from None
    except RecursionError:
        raise RequestError("the body nests too deeply") from None
    except ValueError as exc:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        raise RequestError(f"the body has a value JSON decoding refused: {str(exc)[:120]}") from None
    return parse_generate(body, vocab_size=vocab_size, max_context_len=max_context_len,
                          default_max_new_tokens=default_max_new_tokens)


def text_of_tokens(tokens: list[int]) -> str:
    """Inverse of :func:`tokens_of_text`; tokens above 255 and broken UTF-8 become U+FFFD.

    A token that is no byte stands in as 0xFF, a byte UTF-8 never uses: the decoder replaces
    each with exactly one U+FFFD, as documented (it was ``?``, which read as real text)."""
    return bytes(t if 0 <= t < 256 else 0xFF for t in tokens).decode("utf-8", errors="replace")


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {quoted(value)}")
    return value


def _opt_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 256:
        raise RequestError(f"{name} must be a non-empty string of at most 256 characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{name} is not valid Unicode text") from None
    return value


def parse_generate(
    body: Any, *, vocab_size: int, max_context_len: int, default_max_new_tokens: int
) -> GenerateRequest:
    """Validate a decoded JSON body; raises :class:`RequestError` naming the bad field."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise RequestError(f"{len(unknown)} unknown field(s) {quoted(unknown)}; allowed: {sorted(_KNOWN)}")
    has_tokens, has_prompt = "tokens" in body, "prompt" in body
    if has_tokens == has_prompt:
        raise RequestError("give exactly one of 'tokens' (list of ints) or 'prompt' (string)")
    if has_prompt:
        if not isinstance(body["prompt"], str):
            raise RequestError("prompt must be a string")
        tokens = tokens_of_text(body["prompt"])
    else:
        raw = body["tokens"]
        if not isinstance(raw, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            raise RequestError("tokens must be a list of integers")
        tokens = raw
    if not tokens:
        raise RequestError("the prompt is empty")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token {quoted(bad)} is outside the vocabulary [0, {vocab_size})")
    n_new = body.get("max_new_tokens", default_max_new_tokens)
    if not isinstance(n_new, int) or isinstance(n_new, bool) or n_new <= 0:
        raise RequestError(f"max_new_tokens must be a positive integer, got {quoted(n_new)}")
    if len(tokens) + n_new > max_context_len:
        raise RequestError(
            f"prompt ({len(tokens)} tokens) plus max_new_tokens ({quoted(n_new)}) exceeds the context limit "
            f"{max_context_len}"
        )
    return GenerateRequest(
        rid=_opt_str(body, "rid") or uuid.uuid4().hex[:16],
        tokens=tokens,
        max_new_tokens=n_new,
        session_id=_opt_str(body, "session_id"),
        end_session=_flag(body, "end_session"),
        stream=_flag(body, "stream"),
        debug_reference=_flag(body, "debug_reference"),
        from_text=has_prompt,
    )
