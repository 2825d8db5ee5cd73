# Stub for the optional C extension built from _pagehash.c (see setup.py). ``data`` and
# ``prior`` are any objects with the buffer protocol (bytes, bytearray, array, memoryview).
from typing import Any

def chain_hex(data: Any, page_bytes: int, prior: Any = b"", /) -> list[str]: ...
