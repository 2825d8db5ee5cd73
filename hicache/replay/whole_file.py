"""Writing a file whole: a failed write leaves the file that was there.

Why: the command line's outputs (a trace ``hicache workload`` writes, the plot ``hicache size``
draws) were written in place, so a write that failed halfway (a full disk, a file size limit,
Ctrl-C) left the file truncated to part of the new one, or empty.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["written_whole"]


@contextlib.contextmanager
def written_whole(path: str | os.PathLike[str]) -> Iterator[str]:
    """A temporary path beside ``path`` to write to, renamed over ``path`` when the block ends
    and removed if it raises: a failed write leaves the file that was there (written in place,
    a plot or a trace was truncated to part of the new one, or left empty). A symlink's target
    is replaced, as ``open()`` would have written it. A target that exists and is no regular
    file (a pipe, ``/dev/stdout``, a device) is written in place: there is nothing to keep, and
    a temporary file beside ``/proc/self/fd/pipe:[...]`` cannot be made. Asked of ``path``
    itself, not of its real path: ``/dev/stdout`` into a pipe resolves to that name, which is no
    path, so the pipe was taken for a file not there yet."""
    final = os.path.realpath(path)
    if os.path.exists(path) and not os.path.isfile(path):
        yield os.fspath(path)
        return
    tmp = f"{final}.{os.getpid()}.tmp"
    try:
        yield tmp
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
