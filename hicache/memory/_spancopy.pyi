# Stub for the optional C extension built from _spancopy.c (see setup.py). The buffers are any
# objects with the buffer protocol (numpy arrays included, whose stubs declare no __buffer__
# before Python 3.12), hence Any.
from typing import Any

STREAM_KIND: str

def copy_spans(
    dst: Any,
    src: Any,
    spans: Any,
    dst_shift: int = 0,
    src_shift: int = 0,
    streaming: bool = False,
) -> int: ...
def _set_stream_kind(kind: str, /) -> str: ...
