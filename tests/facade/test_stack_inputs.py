"""``StackConfig`` / ``build_stack`` given values of the wrong type: one ConfigError naming the
field, before anything is built, never a TypeError or AttributeError from deep in the wiring."""

from __future__ import annotations

from typing import Any

import pytest

from hicache.controller.config import ControllerConfig
from hicache.errors import ConfigError
from hicache.stack import StackConfig, build_stack


@pytest.mark.parametrize("field, value, words", [
    # was: AttributeError: 'dict' object has no attribute 'io_thread_nice'
    ("controller", {"write_policy": "write_back"}, "controller must be valid .*ControllerConfig"),
    # was: TypeError: '<=' not supported between instances of 'str' and 'int'
    ("page_size", "16", "page_size must be an integer"),
    # was: ValueError: size (160.0) must be a positive multiple of page_size (64)
    ("device_pages", 2.5, "device_pages must be an integer"),
    # was: TypeError: 'NoneType' object is not iterable
    ("storage_options", None, "storage_options must be valid"),
    ("storage_backend", 3, "storage_backend must be a string or null"),
])
async def test_a_value_of_the_wrong_type_names_its_field(field: str, value: Any, words: str) -> None:
    with pytest.raises(ConfigError, match=f"stack option {words}"):
        build_stack(StackConfig(**{field: value}))


async def test_a_stack_of_the_right_types_still_builds() -> None:
    stack = build_stack(StackConfig(page_size=16, device_pages=8, host_pages=16, storage_backend="memory",
                                    storage_options={"max_bytes": 1 << 20},
                                    controller=ControllerConfig.from_dict({"write_policy": "write_back"})))
    try:
        assert stack.allocator.size == 8 * 16
    finally:
        await stack.aclose()
