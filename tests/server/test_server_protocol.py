"""Request validation without HTTP."""

from __future__ import annotations

import pytest

from hicache.server.protocol import RequestError, parse_generate, text_of_tokens, tokens_of_text

LIMITS = dict(vocab_size=256, max_context_len=100, default_max_new_tokens=8)


def test_text_prompts_map_to_utf8_bytes_and_back() -> None:
    req = parse_generate({"prompt": "héllo"}, **LIMITS)
    assert req.tokens == list("héllo".encode()) and req.from_text and req.max_new_tokens == 8
    assert text_of_tokens(tokens_of_text("héllo")) == "héllo"
    assert text_of_tokens([0xFF, 300]) == "\ufffd\ufffd"


def test_tokens_that_are_no_byte_become_the_replacement_character() -> None:
    """The docstring said U+FFFD; the code wrote ``?``, indistinguishable from a real one."""
    assert text_of_tokens([ord("h"), 300, ord("i"), -1]) == "h\ufffdi\ufffd"
    assert text_of_tokens([0xC3, 256, 0xA9]) == "\ufffd\ufffd\ufffd"  # a split character: each piece
    assert text_of_tokens([0xC3, 0xA9, 1000]) == "\u00e9\ufffd"


def test_defaults_and_flags() -> None:
    req = parse_generate({"tokens": [1, 2], "max_new_tokens": 3, "session_id": "s", "end_session": True,
                          "stream": True, "debug_reference": True, "rid": "r1"}, **LIMITS)
    assert (req.rid, req.session_id, req.end_session, req.stream, req.debug_reference) == ("r1", "s", True, True, True)
    assert len(parse_generate({"tokens": [1]}, **LIMITS).rid) == 16


@pytest.mark.parametrize(
    "body, words",
    [
        ([1, 2], "JSON object"),
        ({}, "exactly one"),
        ({"tokens": [1, True]}, "list of integers"),
        ({"tokens": [256]}, "outside the vocabulary"),
        ({"tokens": [-1]}, "outside the vocabulary"),
        ({"prompt": 5}, "string"),
        ({"prompt": ""}, "empty"),
        ({"tokens": [1], "max_new_tokens": True}, "positive integer"),
        ({"tokens": [1] * 95, "max_new_tokens": 6}, "context limit"),
        ({"tokens": [1], "session_id": ""}, "session_id"),
        ({"tokens": [1], "end_session": 1}, "end_session"),
        ({"tokens": [1], "top_p": 1}, "unknown field"),
    ],
)
def test_invalid_bodies_name_the_problem(body: object, words: str) -> None:
    with pytest.raises(RequestError, match=words):
        parse_generate(body, **LIMITS)
