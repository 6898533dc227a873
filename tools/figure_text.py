"""Record the smallest text of every figure a notebook shows (run at kernel start by make execute).

A figure is a PNG that the book scales to the width of the page: on a phone (390 CSS px wide) a
label drawn at 10 pt in a 10-inch figure ends up 5 px tall, too small to read. What the PNG
cannot tell afterwards, the kernel can while it draws: this file wraps the inline backend's
`_fetch_figure_metadata`, which it calls for every figure it displays, so that the figure's output
carries one more metadata entry::

    "mha_text": {"min_pt": 9.0, "width_in": 6.4, "fraction": 0.0195}

`min_pt` is the size of the smallest text the figure draws (tick labels, legends, titles,
annotations: every visible, non-empty `Text` inside the figure), `width_in` the width of the saved
PNG in inches (the inline backend saves with ``bbox_inches="tight"``, 0.1 in of padding), and
`fraction` their ratio (both None for a figure without text), the height of that text as a fraction of the image's width. A browser
showing the image `w` CSS px wide draws that text `fraction * w` px tall: tests/test_browser.py
asserts it is at least 9 px at phone width. Output metadata is never compared with the stored one
(nbval's rules), and the Colab-path test does not load this file, so nothing else changes.
"""

from __future__ import annotations

import matplotlib_inline.backend_inline as inline
from matplotlib.text import Text

PAD_INCHES = 0.1  # matplotlib's savefig.pad_inches, which the inline backend's tight bbox adds
_fetch = inline._fetch_figure_metadata


def smallest_text(fig) -> dict:
    """The size of the smallest visible text of ``fig`` against the width of its saved image."""
    fig.canvas.draw()  # lays the figure out (constrained layout, tick labels) as the PNG will
    renderer = fig.canvas.get_renderer()
    sizes = [
        float(t.get_fontsize())
        for t in fig.findobj(Text)
        if t.get_visible()
        and t.get_text().strip()
        and t.get_window_extent(renderer).overlaps(fig.bbox)
    ]
    width_in = fig.get_tightbbox(renderer).width + 2 * PAD_INCHES
    if not sizes:  # a picture without words
        return {"min_pt": None, "width_in": round(width_in, 3), "fraction": None}
    min_pt = min(sizes)
    return {
        "min_pt": round(min_pt, 2),
        "width_in": round(width_in, 3),
        "fraction": round(min_pt / 72 / width_in, 5),
    }


def _fetch_figure_metadata(fig):
    return {**(_fetch(fig) or {}), "mha_text": smallest_text(fig)}


inline._fetch_figure_metadata = _fetch_figure_metadata
