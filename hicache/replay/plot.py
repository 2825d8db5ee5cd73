"""A line plot as a standalone SVG file, written by hand so the CLI needs no plotting library.

Why not matplotlib: ``hicache size`` must work on a bare server install; an SVG of a few
polylines and labels is a page of text any browser opens.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from xml.sax.saxutils import escape

from hicache.replay.whole_file import written_whole

__all__ = ["write_svg_plot"]

# what XML 1.0 forbids in a document (control characters, lone surrogates: a file name that is
# not UTF-8 decodes to those), each shown as U+FFFD instead
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")

_W, _H, _L, _R, _T, _B = 720, 440, 70, 20, 40, 60
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
    if log:
        a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        return [10.0**e for e in range(a, b + 1) if lo <= 10.0**e <= hi]
    step = (hi - lo) / 5
    return [lo + i * step for i in range(6)]


def _text(s: str) -> str:
    """``s`` as SVG text: a trace's file name (the title) may hold bytes that are not UTF-8 or
    control characters, which made the plot fail to encode, or a file no XML reader opens."""
    return escape(_NOT_XML.sub("\ufffd", s))


def _write_whole(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` whole (see :func:`written_whole`)."""
    with written_whole(path) as tmp:
        # a temporary file is new (O_EXCL); a pipe or device is written in place, where O_EXCL
        # failed with 'File exists'
        fresh = os.O_CREAT | os.O_EXCL if tmp != os.fspath(path) else 0
        fd = os.open(tmp, os.O_WRONLY | fresh, 0o666)  # the umask's mode, as open()
        with os.fdopen(fd, "wb") as f:
            f.write(data)


def write_svg_plot(
    path: str | os.PathLike[str],
    series: dict[str, Sequence[tuple[float, float]]],
    *,
    title: str,
    x_label: str,
    y_label: str,
    log_x: bool = True,
    markers: Sequence[tuple[float, str]] = (),
) -> None:
    """Plot ``series`` (name -> ``(x, y)`` points, y in [0, 1]) to ``path``; ``markers`` are
    vertical dashed lines ``(x, label)`` (tier sizes)."""
    xs = [x for pts in series.values() for x, _ in pts if not log_x or x > 0]
    if not xs:
        raise ValueError("nothing to plot")
    lo, hi = min(xs), max(xs)
    if hi <= lo:
        hi = lo * 10 if log_x else lo + 1

    def px(x: float) -> float:
        f = (math.log10(x) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) if log_x else (x - lo) / (hi - lo)
        return _L + f * (_W - _L - _R)

    def py(y: float) -> float:
        return _H - _B - y * (_H - _T - _B)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" font-family="sans-serif" font-size="12">',
        f'<rect width="{_W}" height="{_H}" fill="white"/>',
        f'<text x="{_W / 2}" y="22" text-anchor="middle" font-size="14">{_text(title)}</text>',
        f'<line x1="{_L}" y1="{py(0)}" x2="{_W - _R}" y2="{py(0)}" stroke="black"/>',
        f'<line x1="{_L}" y1="{py(0)}" x2="{_L}" y2="{py(1)}" stroke="black"/>',
        f'<text x="{_W / 2}" y="{_H - 15}" text-anchor="middle">{_text(x_label)}</text>',
        f'<text x="18" y="{_H / 2}" text-anchor="middle" transform="rotate(-90 18 {_H / 2})">{_text(y_label)}</text>',
    ]
    for y in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0):
        out.append(f'<line x1="{_L}" y1="{py(y):.1f}" x2="{_W - _R}" y2="{py(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{_L - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.1f}</text>')
    for x in _ticks(lo, hi, log_x):
        out.append(f'<text x="{px(x):.1f}" y="{py(0) + 16:.1f}" text-anchor="middle">{x:,.0f}</text>')
    for x, label in markers:
        if lo <= x <= hi:
            out.append(f'<line x1="{px(x):.1f}" y1="{py(0):.1f}" x2="{px(x):.1f}" y2="{py(1):.1f}" '
                       'stroke="#888" stroke-dasharray="4 3"/>')
            out.append(f'<text x="{px(x) + 3:.1f}" y="{py(1) + 12:.1f}" fill="#555">{_text(label)}</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = _COLORS[i % len(_COLORS)]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts if not log_x or x > 0)
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        out.append(f'<text x="{_L + 10}" y="{_T + 16 + 16 * i}" fill="{color}">{_text(name)}</text>')
    out.append("</svg>")
    _write_whole(path, ("\n".join(out) + "\n").encode("utf-8"))  # encoded whole before the file is touched
