"""The built book as files: what every page must hold that needs neither layout nor JavaScript.

Each page of both editions (_build/html and the Chinese one under _build/html/zh/) is parsed with
an HTML parser (selectolax) and checked: every internal link and image reaches a file that
exists, and a `#fragment` an element with that id; every image has alt text, and every figure a
description, a caption, a link to its full-size file and twice its display width in pixels;
solutions are folded dropdowns with a body; each script is in the page once; the page's title,
exercises, solutions, figures, Colab link and language switch match its notebook; the Chinese
figures were drawn with Chinese labels (the labels each PNG was drawn with are in its text
chunk, tools/figure_text.py); the search index finds the page that teaches each term and the
glossary's terms in both languages. What needs a browser (layout, typeset math, fonts, colours,
taps, the search page itself) is in tests/test_browser.py, which imports the book's facts from
here.

The tests that read the built book are marked `browser`: they run in `make test-browser`, after
`make book` (locally they skip without a built book; with CI set they fail). The tests of the
checks themselves, on small hand-made pages, need no book and run with the unit tests.
"""

from __future__ import annotations

import functools
import json
import os
import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest
import snowballstemmer
from conftest import REPO, read_yaml, skip_or_fail, toc_chapter_files
from selectolax.lexbor import LexborHTMLParser, LexborNode

HTML = Path(os.environ.get("BOOK_HTML", REPO / "_build" / "html"))
TOC = read_yaml(REPO / "_toc.yml")
ZH_TOC = read_yaml(REPO / "zh" / "_toc.yml")
CONFIG = read_yaml(REPO / "_config.yml")
ROOT = f"{TOC['root']}.html"
CHAPTERS = [f for f in toc_chapter_files(TOC) if f.startswith("chapters/")]
PAGES = [ROOT] + [f"{c}.html" for c in CHAPTERS]
# The notebooks among them (the others are markdown pages: the landing page, posts, glossary).
NOTEBOOK_CHAPTERS = [c for c in CHAPTERS if (REPO / f"{c}.ipynb").exists()]
ZH_CHAPTERS = [f for f in toc_chapter_files(ZH_TOC) if f.startswith("chapters/")]
ZH_PAGES = [f"{ZH_TOC['root']}.html"] + [f"{c}.html" for c in ZH_CHAPTERS]
# Both editions, as paths under the site: "chapters/x.html" and "zh/chapters/x.html".
ALL_PAGES = PAGES + [f"zh/{p}" for p in ZH_PAGES]
CJK = re.compile(r"[\u4e00-\u9fff]")
UNTRANSLATED = "本章尚未译成中文"  # the note on a Chinese page whose chapter is not translated yet


# --- the book's facts, from its sources -----------------------------------------------------------


@functools.cache
def notebook_facts(stem: str, edition: str = "en") -> dict:
    """What the page of notebook ``stem`` must show, from the English notebook or (``"zh"``) the
    Chinese one that tools/translate.py build made, with its figures' Chinese drawings."""
    folder = REPO / "zh" / "chapters" if edition == "zh" else REPO / "chapters"
    nb = nbformat.read(folder / f"{stem}.ipynb", as_version=4)
    title = next(ln for ln in nb.cells[0].source.splitlines() if ln.startswith("# "))[2:].strip()
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    figures = [  # the PNG outputs the book shows, in page order
        o
        for c in nb.cells
        if c.cell_type == "code"
        and not {"remove-output", "remove-cell"} & set(c.metadata.get("tags", []))
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    return {
        "title": title,
        "exercises": len(re.findall(r"\{exercise(?:-start)?\}", markdown)),
        "solutions": len(re.findall(r"\{solution-start\}", markdown)),
        "pngs": len(figures),
        # What tools/figure_text.py recorded when make execute drew each figure (None: nothing).
        "text": [o.get("metadata", {}).get("mha_text") for o in figures],
    }


def colab_url(stem: str, edition: str = "en") -> str:
    """The notebook the Colab button of page ``stem`` opens, on the configured branch."""
    owner_repo = urlsplit(CONFIG["repository"]["url"]).path.strip("/").removesuffix(".git")
    branch = CONFIG["repository"]["branch"]
    folder = "zh/chapters" if edition == "zh" else "chapters"
    return (
        f"https://colab.research.google.com/github/{owner_repo}/blob/{branch}/{folder}/{stem}.ipynb"
    )


def zh_counterpart(path: str) -> str:
    """The English page that a Chinese page's language switch opens (the landing page for a page
    the English book lacks)."""
    return path if path in PAGES else ROOT


def en_counterpart(path: str) -> str:
    """The Chinese page that an English page's language switch opens."""
    return path if path in ZH_PAGES else ZH_PAGES[0]


# --- reading the built pages ------------------------------------------------------------------------


def parse(file: Path) -> LexborHTMLParser:
    return LexborHTMLParser(file.read_text(encoding="utf-8"))


def built(path: str) -> LexborHTMLParser:
    """The parsed page at ``path`` under the site (missing: skip locally, fail in CI)."""
    if not (HTML / "index.html").exists():
        skip_or_fail(f"no built book in {HTML}; run `make book` first")
    file = HTML / path
    assert file.exists(), f"{path} is not in the built book (make book)"
    return parse(file)


def text_of(node: LexborNode | None, drop: str = ".headerlink") -> str:
    """A node's text with whitespace collapsed, without the elements ``drop`` selects."""
    if node is None:
        return ""
    copy = LexborHTMLParser(node.html or "")
    for el in copy.css(drop):
        el.decompose()
    return " ".join((copy.body.text() if copy.body else "").split())


def unique(nodes: list[LexborNode]) -> list[LexborNode]:
    """Nodes once each (a selector list matches an element once per selector that matches)."""
    seen: dict[int, LexborNode] = {}
    for node in nodes:
        seen.setdefault(node.mem_id, node)
    return list(seen.values())


def resolve(file: Path, url: str, root: Path) -> Path | None:
    """The file under ``root`` that a relative URL on page ``file`` points to, None if it leaves
    the site. The URL has no scheme; its query and fragment are ignored."""
    path = unquote(urlsplit(url).path)
    if not path:
        return file
    base = root if path.startswith("/") else file.parent
    target = (base / path.lstrip("/")).resolve()
    if path.endswith("/") or target.is_dir():
        target = target / "index.html"
    try:
        target.relative_to(root.resolve())
    except ValueError:
        return None
    return target


@functools.cache
def anchors(file: Path) -> frozenset[str]:
    """The fragments a page answers: its elements' ids and its anchors' names."""
    tree = parse(file)
    ids = {n.attributes.get("id") for n in tree.css("[id]")}
    names = {n.attributes.get("name") for n in tree.css("a[name]")}
    return frozenset(x for x in ids | names if x)


# The attributes that load or link another file of the site.
URL_ATTRIBUTES = {
    "a": "href",
    "link": "href",
    "area": "href",
    "img": "src",
    "script": "src",
    "iframe": "src",
    "source": "src",
}


def broken_links(tree: LexborHTMLParser, file: Path, root: Path) -> list[str]:
    """Every internal link, stylesheet, script and image of the page reaches a file of the site,
    and a link with a `#fragment` an element with that id (on the same page, or the target)."""
    problems = []
    for tag, attribute in URL_ATTRIBUTES.items():
        for node in tree.css(f"{tag}[{attribute}]"):
            url = (node.attributes.get(attribute) or "").strip()
            parts = urlsplit(url)
            if parts.scheme or parts.netloc or not url:
                continue  # another site (Colab, GitHub, the MathJax CDN), mailto:, data:
            target = resolve(file, url, root)
            if target is None:
                problems.append(f"<{tag} {attribute}={url!r}> leaves the site")
            elif not target.is_file():
                problems.append(f"<{tag} {attribute}={url!r}>: no file {target.name}")
            elif parts.fragment and target.suffix == ".html":
                fragment = unquote(parts.fragment)
                if fragment not in anchors(target):
                    problems.append(f"<{tag} {attribute}={url!r}>: no id {fragment!r} there")
    return problems


def images_without_alt(tree: LexborHTMLParser) -> list[str]:
    """Images without an alt attribute (alt="" marks a decorative one, which is fine)."""
    return [
        f"<img src={img.attributes.get('src')!r}> has no alt text"
        for img in tree.css("img")
        if img.attributes.get("alt") is None
    ]


def duplicate_scripts(tree: LexborHTMLParser) -> list[str]:
    """Scripts that the page carries twice: the same file (whatever its ?v= digest) or the same
    inline code. A second copy of a script that declares a constant is a script error."""
    seen: set[str] = set()
    problems = []
    for script in tree.css("script"):
        src = script.attributes.get("src")
        key = f"src {urlsplit(src).path}" if src else f"inline {script.text().strip()}"
        if key == "inline ":
            continue
        if key in seen:
            problems.append(f"twice: <script> {key[:120]}")
        seen.add(key)
    return problems


def unfolded_solutions(tree: LexborHTMLParser) -> list[str]:
    """Solutions that would not be folded: each is a dropdown admonition (sphinx-togglebutton
    folds `.admonition.dropdown` when the page loads) with a body to unfold."""
    problems = []
    for number, solution in enumerate(tree.css("article div.solution"), 1):
        classes = (solution.attributes.get("class") or "").split()
        if not {"dropdown", "admonition"} <= set(classes):
            problems.append(f"solution {number} is not a dropdown (classes {classes})")
        if not solution.css_first("section, .cell"):
            problems.append(f"solution {number} is empty")
    return problems


def style_width(img: LexborNode) -> float:
    """The display width in the image's inline style ("width: 551px"), 0 if none."""
    for declaration in (img.attributes.get("style") or "").split(";"):
        name, _, value = declaration.partition(":")
        if name.strip() == "width" and value.strip().endswith("px"):
            return float(value.strip()[:-2])
    return 0.0


def figures(tree: LexborHTMLParser) -> list[LexborNode]:
    """The figures of the notebook outputs, in page order."""
    return tree.css("article .cell_output img")


def figure_problems(tree: LexborHTMLParser, file: Path, root: Path) -> list[str]:
    """Every figure says what it shows (alt text of six words or more, not a file name), has a
    caption, opens full size when tapped (the link around it is its own file), and is stored
    at twice its display width or more (sharp on high-density screens)."""
    from PIL import Image

    problems = []
    for number, img in enumerate(figures(tree), 1):
        src = img.attributes.get("src") or ""
        name = f"figure {number} ({src.rsplit('/', 1)[-1][:12]})"
        alt = img.attributes.get("alt") or ""
        # Six words, or (Chinese, written without spaces) twelve characters.
        if (len(alt.split()) < 6 and len(CJK.findall(alt)) < 12) or ".png" in alt:
            problems.append(f"{name}: alt text {alt!r} does not describe the figure")
        figure = img.parent
        while figure is not None and figure.tag != "figure":
            figure = figure.parent
        caption = figure.css_first("figcaption .caption-text") if figure else None
        if not text_of(caption):
            problems.append(f"{name} has no caption")
        link = img.parent if img.parent is not None and img.parent.tag == "a" else None
        if link is None or link.attributes.get("href") != src:
            problems.append(f"{name} does not open full size (its link is not its own file)")
        target = resolve(file, src, root)
        if target is None or not target.is_file():
            continue  # broken_links reports it
        with Image.open(target) as image:
            stored = image.width
        shown = style_width(img)
        if not shown or stored < 1.9 * shown:
            problems.append(
                f"{name} is stored at {stored} px for a display width of {shown:g} px: "
                "not sharp on a high-density screen"
            )
    return problems


# --- which pages dark mode is checked on -------------------------------------------------------------
# Dark mode changes colours only: the theme swaps CSS variables under [data-theme=dark]; markup,
# names and layout stay as they are, so of axe's rules only the two that read colours can find
# something new in it (tests/test_browser.py: COLOUR_RULES). Which colours an element gets is
# decided by the style rules that match it, and the book's stylesheets (the theme's, Pygments',
# the extensions', book.css) select by element, class and ancestors' classes, with inline styles
# on top. Two elements alike in those (tag, classes, inline style, the set of their ancestors'
# classes) get the same colours. The browser test runs the colour rules in dark mode on the
# fewest pages of each edition that hold, between them, every such kind of element of the book
# (a greedy cover, recomputed from the built pages), instead of on all of them.


def colour_kinds(tree: LexborHTMLParser) -> frozenset[tuple]:
    """The kinds of element of a page, as far as its colours go (above)."""
    kinds = set()
    for node in tree.body.traverse(include_text=False) if tree.body else []:
        if node.tag in ("script", "style", "svg", "path", "-comment"):
            continue
        ancestors: set[str] = set()
        up = node.parent
        while up is not None and up.tag != "html":
            ancestors.update((up.attributes.get("class") or "").split())
            up = up.parent
        classes = tuple(sorted((node.attributes.get("class") or "").split()))
        style = (node.attributes.get("style") or "") if node.tag != "img" else ""
        kinds.add((node.tag, classes, style, frozenset(ancestors)))
    return frozenset(kinds)


def covering_pages(kinds: dict[str, frozenset[tuple]]) -> list[str]:
    """The fewest pages (greedily: each time the page with the most kinds not yet held, ties to
    the first) that hold between them every kind of element of ``kinds`` (page -> its kinds)."""
    left = set().union(*kinds.values()) if kinds else set()
    chosen = []
    while left:
        page = max(kinds, key=lambda p: len(kinds[p] & left))
        chosen.append(page)
        left -= kinds[page]
    return chosen


@functools.cache
def dark_mode_pages() -> frozenset[str]:
    """The pages of both editions whose phone load also checks dark mode: for each edition, the
    fewest that hold every kind of element its pages hold (colour_kinds)."""
    chosen: list[str] = []
    for pages in (PAGES, [f"zh/{p}" for p in ZH_PAGES]):
        chosen += covering_pages({path: colour_kinds(built(path)) for path in pages})
    return frozenset(chosen)


# --- every page, both editions ----------------------------------------------------------------------


def site_files() -> list[str]:
    """Every HTML page of the built site (both editions, with their index, search and genindex
    pages), relative to it; the toc's pages when the book is not built."""
    if not HTML.is_dir():
        return ALL_PAGES
    skip = {"_static", "_sources", "_images"}
    return sorted(
        str(p.relative_to(HTML))
        for p in HTML.rglob("*.html")
        if not skip & set(p.relative_to(HTML).parts)
    )


# The tests that read the built book run in make test-browser (marker "browser"), after make book.
book = pytest.mark.browser


@book
@pytest.mark.parametrize("path", site_files())
def test_links_images_and_scripts(path):
    """Links, anchors, images and scripts of a page: all there, alt text on every image, each
    script once."""
    tree = built(path)
    problems = broken_links(tree, HTML / path, HTML)
    problems += images_without_alt(tree)
    problems += duplicate_scripts(tree)
    assert not problems, f"{path}:\n" + "\n".join(problems)


@book
def test_every_toc_page_is_built():
    built(ROOT)
    missing = [p for p in ALL_PAGES if not (HTML / p).exists()]
    assert not missing, f"pages of the toc not in the built book: {missing}"


@book
def test_landing_page():
    """index.html forwards to the landing page, which has the title, links every chapter, lists
    the whole bibliography and switches to the Chinese landing page."""
    forward = built("index.html").css_first('meta[http-equiv="Refresh" i]')
    assert forward is not None, "index.html does not forward to the landing page"
    content = forward.attributes.get("content") or ""
    assert content.split("url=", 1)[-1].strip() == ROOT, f"index.html forwards to {content!r}"
    tree = built(ROOT)
    assert "Multi-Head Attention" in text_of(tree.css_first("article h1"))
    entries = len(
        re.findall(r"^@\w+\{", (REPO / "references.bib").read_text(encoding="utf-8"), re.MULTILINE)
    )
    shown = len(
        unique(tree.css("article .citation, article dl.citation > dt, article div.citation"))
    )
    assert shown >= entries, f"the bibliography shows {shown} of the {entries} entries"
    hrefs = [a.attributes.get("href") or "" for a in tree.css("article a[href]")]
    for chapter in CHAPTERS:
        name = f"{Path(chapter).name}.html"
        assert any(h.startswith(name) for h in hrefs), f"the landing page does not link {chapter}"


def switch_target(tree: LexborHTMLParser, path: str) -> str:
    """The page (under the site) that the page's one language switch opens."""
    switches = tree.css("a.language-switch")
    assert len(switches) == 1, f"{path}: {len(switches)} language switches"
    target = resolve(HTML / path, switches[0].attributes.get("href") or "", HTML)
    assert target is not None, f"{path}: the language switch leaves the site"
    return str(target.relative_to(HTML.resolve()))


def assert_article_in_main(tree: LexborHTMLParser, path: str) -> None:
    """A search result's snippet is the text of the page's article, which _static/book.js finds
    as `[role="main"] article` (Sphinx's own snippet would begin with the article header's
    buttons); the browser test reads snippets on the search page."""
    assert tree.css_first('[role="main"] article'), f'{path}: no article in [role="main"]'


def colab_links(tree: LexborHTMLParser) -> set[str]:
    return {
        a.attributes.get("href") or ""
        for a in tree.css('a[href^="https://colab.research.google.com/"]')
    }


@book
@pytest.mark.parametrize("path", PAGES)
def test_english_page(path):
    """Its language switch opens the same page in Chinese; a notebook's page shows its title
    (numbered once), all its exercises and figures, folded solutions, and a Colab button that
    opens this very notebook."""
    tree = built(path)
    assert switch_target(tree, path) == f"zh/{en_counterpart(path)}"
    assert_article_in_main(tree, path)
    chapter = path.removesuffix(".html")
    if chapter not in NOTEBOOK_CHAPTERS:
        return
    stem = Path(chapter).name
    facts = notebook_facts(stem)
    problems = []
    h1 = text_of(tree.css_first("article h1"))
    # Sphinx's smart quotes turn a typed apostrophe into a typographic one.
    title = re.sub(r"[`*]", "", facts["title"]).replace("'", "\u2019")
    if "$" not in title and title not in h1:
        problems.append(f"heading {h1!r} does not show the title {title!r}")
    # "8. 8. Title" is numbered twice; "8.1. Title" is section 1 of chapter 8, numbered once.
    if re.match(r"^\d+(?:\.\d+)*\.\s+\d+\.", h1):
        problems.append(f"the title is numbered twice: {h1!r}")
    problems += page_counts(tree, facts, "en")
    problems += unfolded_solutions(tree)
    problems += figure_problems(tree, HTML / path, HTML)
    if colab_links(tree) != {colab_url(stem)}:
        problems.append(f"Colab links {colab_links(tree)}, expected {colab_url(stem)}")
    assert not problems, f"{path}:\n" + "\n".join(problems)


def page_counts(tree: LexborHTMLParser, facts: dict, edition: str) -> list[str]:
    """The page has the notebook's exercises, solutions and figures, each figure's text size
    recorded (tools/figure_text.py; the browser test turns it into pixels on a phone)."""
    problems = []
    exercises = len(tree.css("article div.exercise"))
    if exercises != facts["exercises"]:
        problems.append(f"{exercises} exercises rendered, the notebook has {facts['exercises']}")
    solutions = len(tree.css("article div.solution"))
    if solutions != facts["solutions"]:
        problems.append(f"{solutions} solutions rendered, the notebook has {facts['solutions']}")
    images = len(tree.css("article img"))
    if images < facts["pngs"]:
        problems.append(f"{images} images for {facts['pngs']} PNG outputs")
    shown = len(figures(tree))
    if shown != len(facts["text"]):
        problems.append(
            f"{shown} figures on the page, {len(facts['text'])} in the {edition} notebook"
        )
    for number, text in enumerate(facts["text"], 1):
        if text is None:
            problems.append(f"figure {number}: no text size recorded (run make execute on it)")
    return problems


# English interface strings that a Chinese page must not carry (tools/sphinx_zh.py, translate.py).
ENGLISH_CHROME = (
    "Show code cell source",
    "Click to show",
    "Suggest edit",
    "Print to PDF",
    "列印成 PDF",
    "Color mode",
    "Wide table",
    "Toggle hidden content",
    "Toggle primary sidebar",
    "The multi-head attention course authors",
)
# Those of them that _static/book.js replaces (or writes) when the page runs: the browser test
# checks them on its Chinese pages.
SET_BY_SCRIPT = ("Toggle hidden content", "Toggle primary sidebar", "Wide table")
# The attributes whose words a reader sees or hears (tooltips, accessible names).
SHOWN_ATTRIBUTES = ("title", "aria-label", "data-bs-title", "data-bs-original-title")


def shown_strings(tree: LexborHTMLParser) -> str:
    """The page's text and the attributes a reader sees or hears, with the hints that
    sphinx-togglebutton shows (set by inline scripts)."""
    body = text_of(tree.body, drop="script, style") if tree.body else ""
    attributes = [
        node.attributes.get(a) or "" for a in SHOWN_ATTRIBUTES for node in tree.css(f"[{a}]")
    ]
    hints = [s.text() for s in tree.css("script:not([src])") if "toggleHint" in s.text()]
    return "\n".join([body, *attributes, *hints])


@book
@pytest.mark.parametrize("path", ZH_PAGES, ids=[f"zh/{p}" for p in ZH_PAGES])
def test_chinese_page(path):
    """A page of the Chinese edition: zh-CN, a Chinese title, the notebook's exercises and
    figures with folded solutions, Colab opening the Chinese notebook, the language switch to
    the English page, Chinese interface strings, "Suggest edit" opening the translation file, and
    figures drawn with Chinese labels."""
    tree = built(f"zh/{path}")
    assert_article_in_main(tree, f"zh/{path}")
    problems = []
    lang = tree.css_first("html").attributes.get("lang")
    if lang != "zh-CN":
        problems.append(f'<html lang="{lang}">, expected zh-CN')
    untranslated = any(
        UNTRANSLATED in text_of(note) for note in tree.css("article .admonition.note")
    )
    h1 = text_of(tree.css_first("article h1"))
    if not (untranslated or CJK.search(h1)):
        problems.append(f"the title {h1!r} is not Chinese")
    if switch_target(tree, f"zh/{path}") != zh_counterpart(path):
        problems.append(f"the language switch opens {switch_target(tree, f'zh/{path}')}")
    stem = Path(path).stem
    problems += chinese_interface_problems(tree, stem)
    if f"chapters/{stem}" in NOTEBOOK_CHAPTERS:
        problems += page_counts(tree, notebook_facts(stem, "zh"), "zh")
        english_facts = notebook_facts(stem)
        for kind in ("exercises", "solutions"):
            count = len(tree.css(f"article div.{kind[:-1]}"))
            if count != english_facts[kind]:
                problems.append(f"{count} {kind}, the English notebook has {english_facts[kind]}")
        problems += unfolded_solutions(tree)
        problems += figure_problems(tree, HTML / "zh" / path, HTML)
        if colab_links(tree) != {colab_url(stem, "zh")}:
            problems.append(f"Colab links {colab_links(tree)}, expected {colab_url(stem, 'zh')}")
        if not untranslated:
            problems += chinese_figure_problems(tree, HTML / "zh" / path, stem)
    assert not problems, f"zh/{path}:\n" + "\n".join(problems)


def chinese_interface_problems(tree: LexborHTMLParser, stem: str) -> list[str]:
    """The words around the article are zh_CN (no English interface string; the PDF button and
    the solutions' hint in Chinese), and "Suggest edit" opens the page's translation file."""
    problems = []
    shown = shown_strings(tree)
    english = [s for s in ENGLISH_CHROME if s in shown and s not in SET_BY_SCRIPT]
    if english:
        problems.append(f"English interface strings {english}")
    for chinese in ("打印为 PDF", "点击显示"):
        if chinese not in shown:
            problems.append(f"no {chinese} (an interface string in Chinese)")
    edits = [a.attributes.get("href") or "" for a in tree.css('a[href*="/edit/"]')]
    if (REPO / "i18n" / "zh" / f"{stem}.yml").is_file() and not (
        edits and all(h.endswith(f"/i18n/zh/{stem}.yml") for h in edits)
    ):
        problems.append(f"Suggest edit opens {edits}, not i18n/zh/{stem}.yml")
    return problems


def chinese_figure_problems(tree: LexborHTMLParser, file: Path, stem: str) -> list[str]:
    """Every figure whose English drawing has words is drawn in Chinese on the Chinese page: the
    PNG the page serves names the texts drawn into it (its Description chunk, written by
    tools/figure_text.py from the figure's own text objects); it has Chinese, and none of the
    English drawing's words is left as it was, unless the notebook's table keeps it (a name such
    as softmax). The worked example 猫吃鱼 is drawn with its Chinese tokens."""
    import sys

    from PIL import Image

    sys.path.insert(0, str(REPO / "tools"))
    import figure_text
    import translation_figures
    import translation_files

    table = translation_files.load_figure_labels(stem) or {}
    english = notebook_facts(stem)["text"]
    shown = figures(tree)
    if len(shown) != len(english):
        return [f"{len(shown)} figures, {len(english)} in the English notebook"]
    problems, labels = [], []
    for number, (img, text) in enumerate(zip(shown, english, strict=True), 1):
        words = translation_figures.figure_words(text)
        if not words:
            labels.append([])
            continue
        target = resolve(file, img.attributes.get("src") or "", HTML)
        if target is None or not target.is_file():
            problems.append(f"figure {number}: no file {img.attributes.get('src')}")
            continue
        with Image.open(target) as image:
            description = image.text.get("Description")
        if not description:
            problems.append(f"figure {number} is the English drawing (no Chinese labels)")
            continue
        drawn = json.loads(description)
        left = [s for s in words if s in drawn and figure_text.translate(s, table) != s]
        if left:
            problems.append(f"figure {number} still draws {left} in English")
        if not any(CJK.search(s) for s in drawn):
            problems.append(f"figure {number}: no Chinese in {drawn}")
        labels.append(drawn)
    if stem == "01_2_cat_eats_fish" and labels and not {"猫", "吃", "鱼"} <= set(labels[0]):
        problems.append(f"figure 1 draws {labels[0]}, not 猫 吃 鱼")
    return problems


@book
def test_chinese_checker_output():
    """A Chinese page's checker lines are Chinese."""
    article = text_of(built("zh/chapters/01_2_cat_eats_fish.html").css_first("article"))
    assert "✓ check_seed_head_fix：正确——" in article, "the checker line is not Chinese"
    assert ": correct — " not in article, "an English checker line on a Chinese page"


# --- search: the index each edition ships (searchindex.js), queried as searchtools.js does --------

# Search: each term, on each edition, must list the page that teaches it. Chinese queries are cut
# with the index's own vocabulary (jieba's words, one-character words kept: tools/sphinx_zh.py).
SEARCHES = {
    "zh": {
        "位置编码": "08_1_rope",
        "滑动窗口": "05_4_skipping_masked_tiles",
        "因果掩码": "04_1_masks_as_permissions",
        "头维度": "06_2_flash_kernel",
        "键": "01_1_soft_lookup",
        "值": "01_1_soft_lookup",
        "头": "03_1_one_head_to_many",
        "掩码": "04_masking",
        "缓存": "05_5_kv_cache",
        "在线softmax": "05_3_flash_attention",
        "分块": "05_3_flash_attention",
        "反向传播": "07_1_gradients",
        "填充": "04_1_masks_as_permissions",
    },
    "en": {
        "positional encoding": "01_3_order_and_heads",
        "sliding window": "05_4_skipping_masked_tiles",
        "causal mask": "04_1_masks_as_permissions",
        "head dimension": "02_2_why_scale",
        "key": "01_1_soft_lookup",
        "value": "01_1_soft_lookup",
        "head": "03_1_one_head_to_many",
        "mask": "04_masking",
        "cache": "05_5_kv_cache",
        "online softmax": "05_3_flash_attention",
        "tile": "05_3_flash_attention",
        "backward": "07_1_gradients",
    },
}
HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")


class SearchIndex:
    """An edition's searchindex.js, queried as Sphinx 7.4's searchtools.js does: the query split
    into words (tools/sphinx_zh.py's splitter for Chinese), stop words and numbers dropped, each
    word Porter-stemmed; a page is found when every word is in its text or title (or, for a
    word longer than two letters, inside one of its words), or when the query is most of one of
    its titles. (Object and index-entry matches, which can only add results, are left out.)"""

    def __init__(self, folder: Path, chinese: bool) -> None:
        script = (folder / "searchindex.js").read_text(encoding="utf-8")
        self.index = json.loads(script[script.index("(") + 1 : script.rindex(")")])
        language = (folder / "_static" / "language_data.js").read_text(encoding="utf-8")
        start = language.index("var stopwords = ") + len("var stopwords = ")
        self.stopwords = set(json.loads(language[start : language.index("]", start) + 1]))
        self.chinese = chinese
        self.stemmer = snowballstemmer.stemmer("porter")  # searchtools.js's Porter stemmer

    def known(self, word: str) -> bool:
        return word in self.index["terms"] or word in self.index["titleterms"]

    def split(self, query: str) -> list[str]:
        words = []
        for token in filter(None, re.split(r"\W+", query)):
            if not self.chinese:
                words.append(token)
                continue
            for run in filter(None, re.split(f"({HAN.pattern})", token)):
                if not HAN.fullmatch(run):
                    words.append(run)
                    continue
                i = 0
                while i < len(run):  # the longest word the index knows, left to right
                    j = min(len(run), i + 8)
                    while j > i + 1 and not self.known(run[i:j]):
                        j -= 1
                    if j > i + 1 or self.known(run[i:j]):
                        words.append(run[i:j])
                    i = j
        return words

    def query(self, query: str) -> set[str]:
        """The pages (docnames) the search page lists for ``query``."""
        index = self.index
        terms = set()
        for word in self.split(query.strip()):
            lower = word.lower()
            if lower in self.stopwords or lower.isdigit():
                continue
            terms.add(self.stemmer.stemWord(lower))
        found: dict[int, set[str]] = {}
        for word in terms:
            for table in (index["terms"], index["titleterms"]):
                matches = [table[word]] if word in table else []
                if len(word) > 2 and word not in table:
                    matches += [files for term, files in table.items() if word in term]
                for files in matches:
                    for file in files if isinstance(files, list) else [files]:
                        found.setdefault(file, set()).add(word)
        long_terms = len([t for t in terms if len(t) > 2])
        pages = {
            index["docnames"][file]
            for file, words in found.items()
            if len(words) in (len(terms), long_terms)
        }
        lower = query.lower().strip()
        for title, places in index["alltitles"].items():
            if lower in title.lower().strip() and len(lower) >= len(title) / 2:
                pages |= {index["docnames"][file] for file, _ in places}
        return pages


@functools.cache
def search_index(edition: str) -> SearchIndex:
    folder = HTML / "zh" if edition == "zh" else HTML
    if not (folder / "searchindex.js").exists():
        skip_or_fail(f"no search index in {folder}; run `make book` first")
    return SearchIndex(folder, chinese=edition == "zh")


@book
@pytest.mark.parametrize("edition", sorted(SEARCHES))
def test_search_finds_the_page_of_each_term(edition):
    """Each term's search lists the page that teaches it (every term of SEARCHES; the browser
    test types a few of them into the search page)."""
    index = search_index(edition)
    missed = [
        f"{term!r}: chapters/{stem} not among {sorted(index.query(term))[:8]}"
        for term, stem in SEARCHES[edition].items()
        if f"chapters/{stem}" not in index.query(term)
    ]
    assert not missed, f"{edition} search:\n" + "\n".join(missed)


@book
@pytest.mark.parametrize("edition", ["en", "zh"])
def test_search_finds_the_glossary_terms(edition):
    """Every term of the glossary, searched in its edition's language, lists the glossary page:
    the index holds the Chinese terms whole (one-character words too) and the query is cut into
    the index's words."""
    index = search_index(edition)
    missed = []
    for entry in read_yaml(REPO / "i18n" / "zh" / "glossary.yml")["terms"]:
        term = entry["en"] if edition == "en" else entry["zh"]
        pages = index.query(term)
        if "chapters/glossary" not in pages:
            missed.append(f"{term!r}: the glossary not among {sorted(pages)}")
    assert not missed, f"{edition} search:\n" + "\n".join(missed)


# --- code that must fit a desktop code cell ---------------------------------------------------------


def columns(line: str) -> int:
    """A line's width in monospace columns (a wide character, such as Chinese, takes two)."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)


def widest_code_lines(count: int = 12) -> list[str]:
    """The widest lines of the English chapters' code cells (folded ones included), widest
    first: the browser test shows them in a code cell at desktop width, where none may scroll."""
    lines = set()
    for chapter in NOTEBOOK_CHAPTERS:
        tree = built(f"{chapter}.html")
        for pre in tree.css("article div.cell_input pre"):
            lines |= set(pre.text().split("\n"))
    return sorted(lines, key=lambda s: (-columns(s), s))[:count]


# --- the checks themselves, on hand-made pages (no book needed) -----------------------------------

GOOD_PAGE = """<!DOCTYPE html><html lang="en"><head>
<script src="_static/a.js?v=1"></script><script>const X = 1;</script>
<link rel="stylesheet" href="_static/s.css"></head><body><article>
<a href="#here">same page</a><a href="other.html#there">other page</a><a href="other.html">page</a>
<a href="https://example.org/#nowhere">outside</a><a href="#">top</a>
<h2 id="here">Here</h2>
<div class="solution dropdown admonition"><p class="admonition-title">Solution</p>
<section><p>The answer.</p></section></div>
<div class="cell_output"><figure><a href="_images/f.png"><img src="_images/f.png"
alt="A bar chart of six things side by side" style="width: 20px; height: 10px;"></a>
<figcaption><p><span class="caption-text">Six bars</span></p></figcaption></figure></div>
</article></body></html>"""


@pytest.fixture
def small_site(tmp_path):
    """A site of two pages, a script, a stylesheet and a 40 x 20 PNG."""
    from PIL import Image

    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "a.js").write_text("", encoding="utf-8")
    (tmp_path / "_static" / "s.css").write_text("", encoding="utf-8")
    (tmp_path / "_images").mkdir()
    Image.new("RGB", (40, 20)).save(tmp_path / "_images" / "f.png")
    (tmp_path / "other.html").write_text('<p id="there">There</p>', encoding="utf-8")
    return tmp_path


def all_problems(html: str, site: Path) -> list[str]:
    (site / "page.html").write_text(html, encoding="utf-8")
    tree = parse(site / "page.html")
    anchors.cache_clear()
    return (
        broken_links(tree, site / "page.html", site)
        + images_without_alt(tree)
        + duplicate_scripts(tree)
        + unfolded_solutions(tree)
        + figure_problems(tree, site / "page.html", site)
    )


def test_the_checks_pass_a_good_page(small_site):
    assert all_problems(GOOD_PAGE, small_site) == []


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('href="other.html#there"', 'href="other.html#gone"', "no id 'gone' there"),
        ('href="#here"', 'href="#nothere"', "no id 'nothere' there"),
        ('href="other.html">', 'href="missing.html">', "no file missing.html"),
        ('href="other.html">', 'href="../../up.html">', "leaves the site"),
        ('href="_static/s.css"', 'href="_static/gone.css"', "no file gone.css"),
        ('src="_static/a.js?v=1"', 'src="_static/b.js"', "no file b.js"),
        (
            '<script src="_static/a.js?v=1"></script>',
            '<script src="_static/a.js?v=1"></script><script src="_static/a.js?v=2"></script>',
            "twice: <script> src _static/a.js",
        ),
        (
            "<script>const X = 1;</script>",
            "<script>const X = 1;</script>\n<script> const X = 1; </script>",
            "twice: <script> inline const X = 1;",
        ),
        ('alt="A bar chart of six things side by side" ', "", "has no alt text"),
        ('alt="A bar chart of six things side by side"', 'alt="f.png"', "does not describe"),
        ('<span class="caption-text">Six bars</span>', "", "has no caption"),
        ('<a href="_images/f.png"><img', "<a><img", "does not open full size"),
        ("width: 20px", "width: 30px", "not sharp"),
        ("solution dropdown admonition", "solution admonition", "is not a dropdown"),
        ("<section><p>The answer.</p></section>", "", "solution 1 is empty"),
    ],
)
def test_the_checks_catch_a_broken_page(small_site, old, new, expected):
    assert old in GOOD_PAGE
    problems = all_problems(GOOD_PAGE.replace(old, new), small_site)
    assert any(expected in p for p in problems), problems


def test_the_search_port_splits_chinese_with_the_index_words(tmp_path):
    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "language_data.js").write_text(
        'var stopwords = ["a", "the"];\n', encoding="utf-8"
    )
    index = {
        "docnames": ["chapters/rope", "chapters/keys"],
        "terms": {"位置": [0], "编码": 0, "键": [1], "softmax": [0, 1], "mask": 1},
        "titleterms": {},
        "alltitles": {"Keys and values": [[1, None]]},
    }
    (tmp_path / "searchindex.js").write_text(
        f"Search.setIndex({json.dumps(index)})", encoding="utf-8"
    )
    search = SearchIndex(tmp_path, chinese=True)
    assert search.split("位置编码的键") == ["位置", "编码", "键"]  # 的: not in the index
    assert search.query("位置编码") == {"chapters/rope"}
    assert search.query("键") == {"chapters/keys"}
    assert search.query("the masks") == {"chapters/keys"}  # stemmed; "the" is a stop word
    assert search.query("keys and values") == {"chapters/keys"}  # most of a title
    assert search.query("位置 键") == set()  # every word must be on the page


def test_sphinx_scripts_keeps_one_copy_of_each_script():
    """tools/sphinx_scripts.py drops the second copy that Sphinx 7.4 writes of an inline script
    registered after the builder started (file name None, then "")."""
    import sys

    from sphinx.builders.html._assets import _JavaScript

    sys.path.insert(0, str(REPO / "tools"))
    import sphinx_scripts

    thebe = "const THEBE_JS_URL = 1"
    scripts = [
        _JavaScript("_static/a.js", priority=200),
        _JavaScript(None, priority=500, body=thebe),
        _JavaScript("_static/b.js", priority=500),
        _JavaScript("", priority=500, body=thebe),
        _JavaScript(None, priority=500, body="const other = 2"),
    ]
    context = {"script_files": scripts}
    sphinx_scripts.one_copy_each(None, "page", "page.html", context, None)
    assert context["script_files"] is scripts  # the builder's own list, changed in place
    assert [s.filename for s in scripts] == ["_static/a.js", None, "_static/b.js", None]
    assert [s.attributes.get("body") for s in scripts] == [None, thebe, None, "const other = 2"]


def test_the_dark_mode_pages_hold_every_kind_of_element():
    kinds = {
        "a": frozenset({1, 2}),
        "b": frozenset({2, 3, 4}),
        "c": frozenset({1, 5}),
        "d": frozenset({4}),
    }
    chosen = covering_pages(kinds)
    assert chosen == ["b", "c"]
    assert set().union(*(kinds[p] for p in chosen)) == set().union(*kinds.values())
    assert covering_pages({}) == []


def test_colour_kinds_tell_apart_what_can_be_coloured_differently():
    def kinds(html: str) -> frozenset:
        return colour_kinds(LexborHTMLParser(f"<html><body>{html}</body></html>"))

    plain = kinds('<div class="a"><p>x</p></div>')
    assert plain == kinds('<div class="a"><p>y</p><p>z</p></div>')  # text and count: alike
    assert plain != kinds('<div class="b"><p>x</p></div>')  # another ancestor class
    assert plain != kinds('<div class="a"><p class="c">x</p></div>')  # its own class
    assert plain != kinds('<div class="a"><p style="color: red">x</p></div>')  # inline style
    assert plain != kinds('<div class="a"><span>x</span></div>')  # another element


@book
def test_dark_mode_is_checked_on_every_template():
    """The cover holds the landing page, a chapter's opening page and a section of each edition."""
    chosen = dark_mode_pages()
    for prefix in ("", "zh/"):
        mine = {p for p in chosen if p.startswith("zh/") == bool(prefix)}
        assert mine, f"no {prefix or 'English '}page in the dark-mode cover"
        names = [Path(p).name for p in mine]
        assert any(re.match(r"\d\d_\d_", n) for n in names), f"{prefix}: no section in {names}"
        assert any(re.match(r"\d\d_[a-z]", n) for n in names), f"{prefix}: no opening page"
        assert f"{prefix}{ROOT}" in mine, f"{prefix}: the landing page is not in {names}"
