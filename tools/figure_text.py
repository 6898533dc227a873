"""The words of every figure a notebook shows: their size on a phone, and their Chinese drawing.

make execute's kernels run this file at start (tools/execute_notebook.py, with
``run_name="__mha_figures__"``); it wraps the inline backend's ``_fetch_figure_metadata``, which
the backend calls for every figure it displays, so that the figure's output carries more
metadata. Everything here happens while the kernel still holds the figure, which the PNG alone
could not tell afterwards.

**Size on a phone.** A figure is a PNG that the book scales to the width of the page: on a phone
(390 CSS px wide) a label drawn at 10 pt in a 10-inch figure ends up 5 px tall, too small to
read. The output gets::

    "mha_text": {"min_pt": 9.0, "width_in": 6.4, "fraction": 0.0195, "strings": ["cat", ...]}

`min_pt` is the size of the smallest text the figure draws (tick labels, legends, titles,
annotations: every visible, non-empty `Text` inside the figure), `width_in` the width of the saved
PNG in inches (the inline backend saves with ``bbox_inches="tight"``, 0.1 in of padding), and
`fraction` their ratio (both None for a figure without text), the height of that text as a
fraction of the image's width. A browser showing the image `w` CSS px wide draws that text
`fraction * w` px tall: tests/test_browser.py asserts it is at least 9 px at phone width.
`strings` lists the texts drawn, in the order matplotlib holds them, each once.

**The Chinese drawing.** Where a drawn text holds English words (:func:`needs_translation`), the
same figure is drawn a second time with its texts looked up in the notebook's table of figure
labels (``figures:`` in ``i18n/zh/<stem>.yml``, :func:`translate`), tick labels included, with a
CJK font after the usual ones, and saved as the inline backend saves (same size, same padding).
The output gets::

    "mha_zh": {"image/png": "<base64>", "size": {...}, "strings": ["猫", ...], "mha_text": {...}}

`size` is its width and height as the backend gives them for a "retina" PNG, `strings` are the
texts that drawing holds (also written into the PNG itself, as its
``Description`` text chunk, a JSON list, which the browser test reads from the Chinese page),
and `mha_text` that drawing's sizes; a text the table has no entry for stays English.
`tools/translate.py build` puts that PNG in the Chinese notebook; `translate.py check` fails while
a figure has a missing label or was drawn with a table other than today's. A glyph the fonts lack
stops the run (no empty boxes in place of characters). Output metadata is never compared with the
stored one (nbval's rules), and the Colab-path test does not load this file.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

PAD_INCHES = 0.1  # matplotlib's savefig.pad_inches, which the inline backend's tight bbox adds
# The font for the Chinese drawing's CJK characters (Debian's fonts-noto-cjk), after each text's
# own: matplotlib falls back along a text's list of families, not along one family's list.
CJK_FONT = "Noto Sans CJK SC"
# One number as a figure prints it: 12, -0.5, 3.2e-05, 1,024, 4.1× (a table key writes it {}).
NUMBER = r"[-+−]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"
MATH = re.compile(r"(?<!\\)\$.+?(?<!\\)\$")
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")  # ASCII: 键j is a Chinese word and a letter


# --- which texts are words, and their Chinese ---------------------------------------------------


def needs_translation(text: str) -> bool:
    """Whether a figure text holds an English word: outside ``$…$`` math, a run of two or more
    letters that is not a name from code or an acronym (``float16``, ``q_proj``, ``torch.cat``,
    ``SDPA``, ``L``)."""
    for word in WORD.findall(MATH.sub(" ", text)):
        letters = word.strip("._")
        if len(letters) < 2 or letters.isupper() or re.search(r"[\d_.]", letters):
            continue
        return True
    return False


def translate(text: str, table: dict[str, str]) -> str | None:
    """``text`` in Chinese by the notebook's table, or None where it has no entry. A key is the
    English text as drawn; ``{}`` in a key stands for a number (a measured value that changes
    from run to run), given to the Chinese in the same order."""
    if text in table:
        return table[text]
    for english, chinese in table.items():
        m = _match(english, text)
        if m is None:
            continue
        parts = chinese.split("{}")
        if len(parts) != len(m.groups()) + 1:
            raise ValueError(
                f"figure label {english!r}: its Chinese {chinese!r} has {len(parts) - 1} "
                f"{{}} for {len(m.groups())} numbers"
            )
        return "".join(p + v for p, v in zip(parts, [*m.groups(), ""]))
    return None


def _match(english: str, text: str) -> re.Match | None:
    """``text`` as the table key ``english`` matches it (``{}``: a number), or None."""
    if "{}" not in english:
        return None
    return re.fullmatch(f"({NUMBER})".join(map(re.escape, english.split("{}"))), text)


def matches(english: str, text: str) -> bool:
    """Whether the table key ``english`` gives the Chinese of ``text``."""
    return english == text or _match(english, text) is not None


# --- what a figure draws -------------------------------------------------------------------------


def _texts(fig, renderer) -> list:
    from matplotlib.text import Text

    return [
        t
        for t in fig.findobj(Text)
        if t.get_visible()
        and t.get_text().strip()
        and t.get_window_extent(renderer).overlaps(fig.bbox)
    ]


def smallest_text(fig) -> dict:
    """The size of the smallest visible text of ``fig`` against the width of its saved image,
    and the texts it draws."""
    fig.canvas.draw()  # lays the figure out (constrained layout, tick labels) as the PNG will
    renderer = fig.canvas.get_renderer()
    texts = _texts(fig, renderer)
    sizes = [float(t.get_fontsize()) for t in texts]
    strings = list(dict.fromkeys(t.get_text() for t in texts))
    width_in = fig.get_tightbbox(renderer).width + 2 * PAD_INCHES
    if not sizes:  # a picture without words
        return {"min_pt": None, "width_in": round(width_in, 3), "fraction": None, "strings": []}
    min_pt = min(sizes)
    return {
        "min_pt": round(min_pt, 2),
        "width_in": round(width_in, 3),
        "fraction": round(min_pt / 72 / width_in, 5),
        "strings": strings,
    }


def _translated(inner, table: dict[str, str]):
    """A tick formatter that gives the Chinese of what ``inner`` formats (tick labels are made
    anew at every draw, so setting their text once would not last); an English label without a
    table entry is kept."""
    from matplotlib.ticker import Formatter

    def one(text):
        if not isinstance(text, str):  # a formatter may give labels as they were set (numbers)
            return text
        chinese = translate(text, table) if needs_translation(text) else text
        return text if chinese is None else chinese

    class Translated(Formatter):
        axis = inner.axis

        def format_ticks(self, values):
            return [one(s) for s in inner.format_ticks(values)]

        def __call__(self, x, pos=None):
            return one(inner(x, pos))

        def get_offset(self):
            return one(inner.get_offset())

        def set_locs(self, locs):
            inner.set_locs(locs)

        def format_data(self, value):
            return inner.format_data(value)

        def format_data_short(self, value):
            return inner.format_data_short(value)

    return Translated()


class _Lines(logging.Handler):
    """The messages logged while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def chinese_drawing(fig, table: dict[str, str]) -> dict:
    """Draw ``fig`` with its texts in Chinese, save it as the inline backend saves, and put every
    text and tick formatter back as it was."""
    import matplotlib
    from IPython.core.pylabtools import _pngxy, print_figure
    from matplotlib.text import Text
    from matplotlib_inline.config import InlineBackend

    formatters = [
        (ticker, ticker.formatter)
        for ax in fig.axes
        for axis in (ax.xaxis, ax.yaxis)
        for ticker in (axis.major, axis.minor)
    ]
    originals, families = [], []
    fonts: dict[RcKeyType, Any] = {  # for the tick labels drawn anew
        "font.family": [*matplotlib.rcParams["font.family"], CJK_FONT]
    }
    # A missing glyph is a warning for ordinary text and a log line for math text ($…$ makes
    # matplotlib draw the whole label in its math font, which has no CJK): catch both.
    logged = _Lines()
    logger = logging.getLogger("matplotlib")
    logger.addHandler(logged)
    try:
        with matplotlib.rc_context(fonts), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for t in fig.findobj(Text):  # CJK after each text's own fonts
                families.append((t, t.get_fontfamily()))
                t.set_fontfamily([*t.get_fontfamily(), CJK_FONT])
            for ticker, formatter in formatters:  # set directly: set_major_formatter resets ticks
                ticker.formatter = _translated(formatter, table)
            fig.canvas.draw()
            for t in _texts(fig, fig.canvas.get_renderer()):
                english = t.get_text()
                chinese = translate(english, table) if needs_translation(english) else english
                if chinese is not None and chinese != english:
                    originals.append((t, english))
                    t.set_text(chinese)
            sizes = smallest_text(fig)
            # As the inline backend saves: pixel-doubled where the notebook asks for "retina".
            fmt = "retina" if "retina" in InlineBackend.instance().figure_formats else "png"
            png = print_figure(
                fig,
                fmt,
                metadata={"Description": json.dumps(sizes["strings"], ensure_ascii=False)},
                **InlineBackend.instance().print_figure_kwargs,
            )
        lacking = [str(w.message) for w in caught if "missing from font" in str(w.message)]
        lacking += [line for line in logged.lines if "does not have a glyph" in line]
        if lacking:
            raise RuntimeError(
                "the Chinese drawing of a figure lacks glyphs (is fonts-noto-cjk installed? "
                "is Chinese inside $…$ math, whose font has none?): "
                + "; ".join(dict.fromkeys(lacking))
            )
    finally:
        logger.removeHandler(logged)
        for t, english in originals:
            t.set_text(english)
        for t, family in families:
            t.set_fontfamily(family)
        for ticker, formatter in formatters:
            ticker.formatter = formatter
    width, height = _pngxy(png)
    halve = 2 if fmt == "retina" else 1
    return {
        "image/png": base64.b64encode(png).decode("ascii"),
        "size": {"width": width // halve, "height": height // halve},  # CSS px, as retina's
        "strings": sizes["strings"],
        "mha_text": {k: v for k, v in sizes.items() if k != "strings"},
    }


def _install(table: dict[str, str] | None) -> None:
    import matplotlib_inline.backend_inline as inline

    fetch = inline._fetch_figure_metadata

    def _fetch_figure_metadata(fig):
        text = smallest_text(fig)
        extra = {"mha_text": text}
        if table is not None and any(needs_translation(s) for s in text["strings"]):
            extra["mha_zh"] = chinese_drawing(fig, table)
            fig.canvas.draw()  # lay the English figure out again before the backend saves it
        return {**(fetch(fig) or {}), **extra}

    inline._fetch_figure_metadata = _fetch_figure_metadata


if __name__ == "__mha_figures__":  # run by make execute's kernel; ZH_FIGURES given by it
    _install(globals().get("ZH_FIGURES"))
