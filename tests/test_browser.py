"""The built book, as a reader sees it: every page rendered in headless Chromium.

Needs `make book` (the HTML in _build/html), Debian's `chromium` (or CHROMIUM=/path/to/chrome)
and a local MathJax 3 from `npm ci` (node_modules/mathjax). The book loads MathJax from its CDN;
here that request is answered from the local copy, so the test really checks typeset math, offline.
Any other request that leaves localhost is blocked.

It also reads every page on a phone (390 x 844): the sidebar and the in-page contents open and
their links work, nothing scrolls the page sideways, and axe-core (npm, node_modules/axe-core)
finds no critical or serious accessibility violation, at phone and at desktop width, on the page
at rest (web fonts loaded, transitions and animations ended: see settle()). Every
figure has alt text and a caption, opens full size, is sharp on high-density screens, and keeps
its proportions and a readable size on a phone.

Dark mode changes colours only, so it is checked on the same page load: the reader's system is
switched to dark (the theme follows it live) and axe's colour rules run again.

Locally a missing prerequisite skips the test; with the environment variable CI set it fails.
Screenshots of every chapter land in _build/screenshots/ (phone-*.png at phone width, dark-*.png
in dark mode, zh-*.png for the Chinese edition): the first screen of each page, or the whole page
with BOOK_SCREENSHOTS=full (a long page takes seconds to capture).
"""

from __future__ import annotations

import functools
import json
import mimetypes
import os
import re
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, urljoin, urlparse

import nbformat
import pytest
from conftest import REPO, read_yaml, skip_or_fail, toc_chapter_files, toc_chapters

sys.path.insert(0, str(REPO / "tools"))
import figure_text  # noqa: E402 (tools/ is not a package: it joins the path first)
import translation_figures  # noqa: E402
import translation_files  # noqa: E402

pytestmark = pytest.mark.browser

HTML = Path(os.environ.get("BOOK_HTML", REPO / "_build" / "html"))
SCREENSHOTS = REPO / "_build" / "screenshots"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
MATHJAX_LOCAL = REPO / "node_modules" / "mathjax" / "es5"
MATHJAX_CDN = "https://cdn.jsdelivr.net/npm/mathjax@3/es5/"
AXE_JS = REPO / "node_modules" / "axe-core" / "axe.min.js"
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
FULL_PAGE_SCREENSHOTS = os.environ.get("BOOK_SCREENSHOTS") == "full"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
]
CHAPTERS = [f for f in toc_chapter_files(read_yaml(REPO / "_toc.yml")) if f.startswith("chapters/")]
CONFIG = read_yaml(REPO / "_config.yml")
PAGES = [f"{read_yaml(REPO / '_toc.yml')['root']}.html"] + [f"{c}.html" for c in CHAPTERS]
# The notebooks among them (the others are markdown pages: the posts, the glossary).
NOTEBOOK_CHAPTERS = [c for c in CHAPTERS if (REPO / f"{c}.ipynb").exists()]

# TeX that MathJax should have consumed; seen in the page text, it means math was not typeset.
RAW_TEX = re.compile(
    r"\$\$|\\\(|\\\)|\\\[|\\\]|\\(?:frac|sqrt|begin|end|mathbb|operatorname|text)\b"
    r"|\$[^$\s][^$\n]{0,80}?(?<!\s)\$"  # $inline$ math that stayed text
)

# Text of the article without code, outputs and typeset math (where TeX-like text is legitimate).
ARTICLE_TEXT_JS = """() => {
  const article = document.querySelector('article') || document.body;
  const copy = article.cloneNode(true);
  copy.querySelectorAll('pre, code, mjx-container, script, style, .cell_output, .math')
      .forEach(el => el.remove());
  return copy.textContent;
}"""

# Every math element Sphinx wrote must now hold MathJax output; list those that do not, and every
# formula whose internal MathML has an error or an undefined macro (MathJax draws those in red).
MATH_PROBLEMS_JS = """() => {
  const untypeset = [...document.querySelectorAll('.math')]
      .filter(el => !el.querySelector('mjx-container')).map(el => el.textContent.slice(0, 80));
  const broken = [];
  for (const item of MathJax.startup.document.math) {
    const mml = MathJax.startup.toMML(item.root);
    if (/<merror|mathcolor="red"/.test(mml)) broken.push(item.math.slice(0, 80));
  }
  return {count: document.querySelectorAll('mjx-container').length,
          errors: document.querySelectorAll('mjx-merror').length, untypeset, broken};
}"""

IMAGES_JS = """async () => {
  const imgs = [...document.querySelectorAll('article img')];
  imgs.forEach(img => { img.loading = 'eager'; });
  await Promise.all(imgs.map(img => img.complete ? null :
      new Promise(resolve => { img.onload = img.onerror = resolve; })));
  return imgs.map(img => ({src: img.getAttribute('src'), width: img.naturalWidth}));
}"""

# The figures of the notebook outputs, as drawn: alt text, caption, the link around the image
# (Sphinx links a scaled image to its full-size file), display size and stored size.
FIGURES_JS = """() => [...document.querySelectorAll('article .cell_output img')].map(img => {
  const link = img.closest('a');
  const caption = img.closest('figure')?.querySelector('figcaption .caption-text');
  return {src: img.getAttribute('src'), alt: img.getAttribute('alt') || '',
          href: link ? link.getAttribute('href') : null,
          caption: caption ? caption.textContent.trim() : '',
          styleWidth: parseFloat(img.style.width) || 0,
          naturalWidth: img.naturalWidth, naturalHeight: img.naturalHeight,
          shownWidth: img.clientWidth, shownHeight: img.clientHeight};
})"""

# Code blocks whose lines do not fit the text column (the block scrolls sideways), with their
# longest line: the code cells (at desktop width; package code shown with literalinclude is 100
# columns wide and scrolls there), or every code block but printed output (on a phone, where
# code wraps). Cells folded away (hidden input, closed solutions) have no box until opened.
CODE_OVERFLOW_JS = """selector => [...document.querySelectorAll(selector)]
  .filter(pre => !pre.closest('.cell_output'))
  .filter(pre => pre.offsetParent !== null && pre.scrollWidth > pre.clientWidth + 1)
  .map(pre => pre.textContent.split('\\n')
                 .reduce((a, b) => (a.length >= b.length ? a : b)).slice(0, 100))"""
CODE_CELLS = "article div.cell_input pre"
ALL_CODE = "article div.highlight pre"


# sphinx-thebe 0.3.1 writes its inline config script twice into every page under Sphinx 7.4, so
# the second copy fails with this SyntaxError. Thebe (live code in the page) is not enabled in this
# book, so nothing depends on that script; any other JavaScript error fails the test.
KNOWN_PAGE_ERRORS = {"Identifier 'THEBE_JS_URL' has already been declared"}


# Elements that stick out to the right of the viewport without a scrolling box around them, that
# is, what makes the page itself scroll sideways. Drawers parked off-screen (position: fixed)
# do not widen the page, so they do not count.
PAGE_OVERFLOW_JS = """() => {
  const width = document.documentElement.clientWidth;
  const inScrollBox = el => {
    for (let a = el.parentElement; a && a !== document.body; a = a.parentElement) {
      const s = getComputedStyle(a);
      if (s.position === 'fixed' || ['auto', 'scroll', 'hidden', 'clip'].includes(s.overflowX))
        return true;
    }
    return false;
  };
  const culprits = [...document.querySelectorAll('body *')]
    .filter(el => el.getBoundingClientRect().right > width + 1 && !inScrollBox(el)
                  && getComputedStyle(el).position !== 'fixed')
    .map(el => `${el.tagName.toLowerCase()}.${[...el.classList].join('.')} `
               + `(right edge ${Math.round(el.getBoundingClientRect().right)} px): `
               + (el.textContent || '').trim().slice(0, 60));
  return {scrollWidth: document.documentElement.scrollWidth, width, culprits};
}"""

# Display math must fit the text column: a formula wider than that scrolls inside its own box
# (overflow-x auto on the mjx-container) instead of widening the page or being cut off.
WIDE_CONTENT_JS = """() => {
  const article = document.querySelector('article').getBoundingClientRect();
  const math = [...document.querySelectorAll('article mjx-container[display="true"]')]
    .filter(el => {
      const r = el.getBoundingClientRect();
      const scrolls = ['auto', 'scroll'].includes(getComputedStyle(el).overflowX);
      return r.right > article.right + 1 || (el.scrollWidth > el.clientWidth + 1 && !scrolls);
    })
    .map(el => (el.getAttribute('aria-label') || el.textContent).slice(0, 60));
  // A table wider than its box scrolls inside it, with a visible hint above it, and can be
  // scrolled from the keyboard.
  const tables = [...document.querySelectorAll('article .pst-scrollable-table-container')]
    .filter(box => box.scrollWidth > box.clientWidth + 1)
    .filter(box => {
      const hint = box.previousElementSibling;
      return !(hint && hint.classList.contains('book-scroll-hint') && hint.offsetHeight > 0
               && box.tabIndex === 0);
    })
    .map(box => box.textContent.trim().slice(0, 60));
  return {math, tables};
}"""

# axe-core's findings that are not the book's to fix: elements of the theme's own chrome, which
# the book cannot change from its side. Each is listed with its reason; everything else on the
# page, the theme's navigation included, is checked.
AXE_EXCLUDE = [
    # pydata-sphinx-theme 0.16.1's light/dark switch: its aria-label "Color mode" does not contain
    # the titles of its icons (Light, Dark, System Settings), label-content-name-mismatch
    # (serious). Its markup comes from the theme's template.
    ".theme-switch-button",
    # The theme's search field in the desktop sidebar: aria-label "Search", visible text
    # "Search" plus the shortcut "Ctrl+K", label-content-name-mismatch (serious); theme template.
    ".search-button-field",
]


# axe-core measures colour contrast from each element's computed colours and opacity at the
# moment it runs, so the page must be at rest first. A folded solution fades in when opened
# (sphinx-togglebutton: `transition: opacity .3s`), and while axe runs (long script tasks) the
# page draws no frame and Chromium's animation clock stands still, so axe measured the solution
# the test had just opened at whatever opacity it had when axe started, by chance: 0 (the
# fade not yet started; axe skipped the cell as invisible), 0.5-0.8 (its code tokens measured
# 2.2-4.47:1 instead of 6.7:1 and more: the flaky failure on chapter 6's #codecell42) or 1.
# Transitions and animations are therefore ended, in their final state (the one a reader
# sees), and web fonts loaded before axe runs. No colour is changed, so a real contrast problem
# still fails. The screenshots taken after axe show the same settled page.
SETTLED_CSS = """*, *::before, *::after {
  transition: none !important;
  animation-delay: 0s !important;
  animation-duration: 0s !important;
  animation-iteration-count: 1 !important;
}"""
SETTLE_JS = """async () => {
  await document.fonts.ready;
  for (const a of document.getAnimations()) {
    if (a.effect && a.effect.getComputedTiming().endTime !== Infinity) a.finish();
  }
  await new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)));
  return document.getAnimations().filter(a => a.playState === 'running').map(a => {
    const el = a.effect && a.effect.target;
    return `${a.animationName || a.transitionProperty || a.id || 'animation'} on `
           + (el ? `${el.tagName.toLowerCase()}.${[...el.classList].join('.')}` : '?');
  });
}"""


def settle(page) -> None:
    """Bring the page to rest: web fonts loaded, every transition and animation at its end."""
    page.add_style_tag(content=SETTLED_CSS)
    running = page.evaluate(SETTLE_JS)
    assert not running, f"{page.url}: still animating after settling, axe would race it: {running}"


def axe_violations(page, rules: list[str] | None = None) -> list[str]:
    """Critical and serious axe-core violations on the page, outside AXE_EXCLUDE: of every rule
    axe runs by default, or only of ``rules``."""
    settle(page)
    if not page.evaluate("() => typeof window.axe === 'object'"):
        page.add_script_tag(content=AXE_JS.read_text(encoding="utf-8"))
    violations = page.evaluate(
        """async ([exclude, rules]) => {
          const options = {resultTypes: ['violations']};
          if (rules) options.runOnly = {type: 'rule', values: rules};
          const result = await axe.run({exclude: exclude.map(s => [s])}, options);
          return result.violations
            .filter(v => v.impact === 'critical' || v.impact === 'serious')
            .map(v => `${v.impact} ${v.id} (${v.help}): `
                      + v.nodes.slice(0, 5).map(n => n.target.join(' ')).join(' | '));
        }""",
        [AXE_EXCLUDE, rules],
    )
    return violations


# The axe rules that read colours: all that dark mode can change (the theme swaps colours by CSS
# variables under [data-theme=dark]; markup, names and layout stay the same).
COLOUR_RULES = ["color-contrast", "link-in-text-block"]


def check_dark_mode(page, path: str, shot: str) -> None:
    """Switch the reader's system to dark mode on the loaded page; the theme follows it, and
    axe's colour rules find nothing critical or serious in dark mode either."""
    page.emulate_media(color_scheme="dark")
    try:
        page.wait_for_function(
            "() => document.documentElement.dataset.theme === 'dark'", timeout=5000
        )
    except Exception:  # noqa: BLE001 - reported with the theme the page shows instead
        theme = page.evaluate("() => document.documentElement.dataset.theme")
        message = f"{path}: the page did not follow the system to dark mode ({theme!r})"
        raise AssertionError(message) from None
    violations = axe_violations(page, rules=COLOUR_RULES)
    assert not violations, f"{path}: accessibility violations in dark mode (axe-core):\n" + (
        "\n".join(violations)
    )
    page.screenshot(path=SCREENSHOTS / f"dark-{shot}.png")


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def site() -> str:
    if not (HTML / "index.html").exists():
        skip_or_fail(f"no built book in {HTML}; run `make book` first")
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(HTML))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        skip_or_fail(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM=...)")
    if not (MATHJAX_LOCAL / "tex-mml-chtml.js").exists():
        skip_or_fail("no local MathJax in node_modules/mathjax; run `npm ci`")
    if not AXE_JS.exists():
        skip_or_fail("no axe-core in node_modules/axe-core; run `npm ci`")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        skip_or_fail("playwright is not installed in this environment")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def open_page(browser, site):
    """open_page(path) -> (page, problems): the page loaded, MathJax finished, problems recorded."""
    yield from page_opener(browser, site, DESKTOP)


@pytest.fixture
def open_phone_page(browser, site):
    """open_page at a phone's viewport (390 x 844, touch, mobile layout)."""
    yield from page_opener(browser, site, PHONE, is_mobile=True, has_touch=True)


def page_opener(browser, site: str, viewport: dict, **options):
    context = browser.new_context(viewport=viewport, **options)
    problems: dict[str, list[str]] = {"mathjax_missing": [], "page_errors": [], "blocked": []}

    def route(r) -> None:
        url = r.request.url
        if url.startswith(site):
            r.continue_()
        elif url.startswith(MATHJAX_CDN):
            local = MATHJAX_LOCAL / urlparse(url).path.removeprefix(urlparse(MATHJAX_CDN).path)
            if local.is_file():
                ctype = mimetypes.guess_type(local.name)[0] or "application/octet-stream"
                r.fulfill(status=200, body=local.read_bytes(), headers={"Content-Type": ctype})
            else:
                problems["mathjax_missing"].append(url)
                r.fulfill(status=404, body="")
        else:
            problems["blocked"].append(url)
            r.abort()

    context.route("**/*", route)

    def open_(path: str, redirects_to: str | None = None):
        page = context.new_page()
        page.on(
            "pageerror",
            lambda exc: str(exc) in KNOWN_PAGE_ERRORS or problems["page_errors"].append(str(exc)),
        )
        response = page.goto(site + path, wait_until="load")
        assert response is not None and response.ok, f"{path}: HTTP {response and response.status}"
        if redirects_to:
            page.wait_for_url(site + redirects_to, wait_until="load", timeout=10_000)
        if page.locator(".math").count():
            page.wait_for_function(
                "() => window.MathJax && MathJax.startup && MathJax.startup.promise"
            )
            page.evaluate("() => MathJax.startup.promise.then(() => true)")
        return page, problems

    try:
        yield open_
    finally:
        context.close()


def source_has_math(path: str) -> bool:
    """Whether the page's source writes math: a chapter's markdown cells, or the landing page."""
    stem = Path(path).stem
    notebook = REPO / "chapters" / f"{stem}.ipynb"
    if notebook.exists():
        nb = nbformat.read(notebook, as_version=4)
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    else:
        page = REPO / "chapters" / f"{stem}.md"
        page = page if page.exists() else REPO / "chapters" / "index.md"
        text = page.read_text(encoding="utf-8")
    return bool(re.search(r"\$[^$\n]+\$|\$\$|\{math\}|\\begin\{", text))


def check_math(page, path: str, problems: dict) -> None:
    math = page.evaluate(MATH_PROBLEMS_JS)
    if source_has_math(path):  # an opening page of sections may have none
        assert math["count"] > 0, f"{path}: no math typeset by MathJax (no mjx-container)"
    assert not problems["mathjax_missing"], (
        f"{path}: MathJax files missing locally: {problems['mathjax_missing']}"
    )
    assert not math["untypeset"], f"{path}: math left untypeset: {math['untypeset']}"
    assert math["errors"] == 0 and not math["broken"], f"{path}: MathJax errors in {math['broken']}"
    leftover = RAW_TEX.findall(page.evaluate(ARTICLE_TEXT_JS))
    assert not leftover, f"{path}: raw TeX in the page text: {leftover[:10]}"


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


def colab_url(stem: str) -> str:
    owner_repo = urlparse(CONFIG["repository"]["url"]).path.strip("/").removesuffix(".git")
    branch = CONFIG["repository"]["branch"]
    return (
        f"https://colab.research.google.com/github/{owner_repo}/blob/{branch}/chapters/{stem}.ipynb"
    )


def test_landing_page(open_page, site):
    root = read_yaml(REPO / "_toc.yml")["root"]
    # The site's index.html forwards to the landing page.
    page, problems = open_page("index.html", redirects_to=f"{root}.html")
    assert "Multi-Head Attention" in page.locator("article h1").first.inner_text()
    assert switch_target(page, site) == f"zh/{root}.html"  # the language switch
    check_math(page, "index.html", problems)
    entries = len(
        re.findall(r"^@\w+\{", (REPO / "references.bib").read_text(encoding="utf-8"), re.MULTILINE)
    )
    shown = page.locator(
        "article .citation, article dl.citation > dt, article div.citation"
    ).count()
    assert shown >= entries, (
        f"the bibliography shows {shown} of the {entries} entries of references.bib"
    )
    for chapter in CHAPTERS:
        assert page.locator(f'article a[href^="{Path(chapter).name}.html"]').count(), (
            f"index does not link {chapter}"
        )
    assert not problems["page_errors"], f"JavaScript errors: {problems['page_errors']}"
    check_wide_content(page, "index.html")
    violations = axe_violations(page)
    assert not violations, "index.html: accessibility violations (axe-core):\n" + "\n".join(
        violations
    )
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / "index.png", full_page=FULL_PAGE_SCREENSHOTS)
    check_dark_mode(page, "index.html", Path(root).name)


@pytest.mark.parametrize("chapter", NOTEBOOK_CHAPTERS, ids=lambda c: Path(c).name)
def test_chapter_page(open_page, site, chapter):
    stem = Path(chapter).name
    path = f"{chapter}.html"
    assert (HTML / path).exists(), f"{path} is not in the built book"
    facts = notebook_facts(stem)
    page, problems = open_page(path)
    assert switch_target(page, site) == f"zh/{path}"  # the language switch

    # It renders: the chapter's own title, numbered once by the toc.
    h1 = page.locator("article h1").first.inner_text().replace("#", "").strip()
    # Sphinx's smart quotes turn a typed apostrophe into a typographic one.
    plain_title = re.sub(r"[`*]", "", facts["title"]).replace("'", "\u2019")
    if "$" not in plain_title:
        assert plain_title in h1, f"{path}: heading {h1!r} does not show the title {plain_title!r}"
    # "8. 8. Title" is numbered twice; "8.1. Title" is section 1 of chapter 8, numbered once.
    twice = re.match(r"^\d+(?:\.\d+)*\.\s+\d+\.", h1)
    assert not twice, f"{path}: the title is numbered twice: {h1!r}"

    check_math(page, path, problems)
    check_wide_content(page, path)

    # Every figure loads; every PNG output of the notebook is on the page.
    images = page.evaluate(IMAGES_JS)
    broken = [img["src"] for img in images if img["width"] == 0]
    assert not broken, f"{path}: images that did not load: {broken}"
    assert len(images) >= facts["pngs"], (
        f"{path}: {len(images)} images for {facts['pngs']} PNG outputs"
    )

    # Every figure says what it shows, has a caption, opens full size when tapped, and is
    # stored at twice its display size (sharp on high-density screens).
    for fig in page.evaluate(FIGURES_JS):
        name = fig["src"].rsplit("/", 1)[-1][:12]
        assert len(fig["alt"].split()) >= 6 and ".png" not in fig["alt"], (
            f"{path}: figure {name}: alt text {fig['alt']!r} does not describe the figure"
        )
        assert fig["caption"], f"{path}: figure {name} has no caption"
        assert fig["href"] == fig["src"], f"{path}: figure {name} does not open full size"
        assert fig["styleWidth"] and fig["naturalWidth"] >= 1.9 * fig["styleWidth"], (
            f"{path}: figure {name} is stored at {fig['naturalWidth']} px for a display width "
            f"of {fig['styleWidth']} px: not sharp on a high-density screen"
        )

    # Code cells fit the text column: chapter code is written at most 80 characters wide.
    wide_code = page.evaluate(CODE_OVERFLOW_JS, CODE_CELLS)
    assert not wide_code, f"{path}: code cells wider than the column:\n" + "\n".join(wide_code)

    # The Colab launch button opens this very notebook on the configured branch.
    hrefs = set(
        page.eval_on_selector_all(
            'a[href^="https://colab.research.google.com/"]', "els => els.map(e => e.href)"
        )
    )
    assert hrefs == {colab_url(stem)}, f"{path}: Colab links {hrefs}, expected {colab_url(stem)}"

    # Exercises render; solutions are folded until the reader opens them.
    exercises = page.locator("article div.exercise")
    assert exercises.count() == facts["exercises"], (
        f"{path}: {exercises.count()} exercises rendered, the notebook has {facts['exercises']}"
    )
    solutions = page.locator("article div.solution")
    assert solutions.count() == facts["solutions"], (
        f"{path}: {solutions.count()} solutions rendered, the notebook has {facts['solutions']}"
    )
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / f"{stem}.png")
    for i in range(solutions.count()):
        solution = solutions.nth(i)
        body = solution.locator("section, .cell").first
        assert body.count(), f"{path}: solution {i + 1} is empty"
        assert not body.is_visible(), f"{path}: solution {i + 1} is shown before it is opened"
        # The chevron button; the title itself also holds a link to the exercise.
        solution.locator("button.toggle-button").first.click()
        body.wait_for(state="visible", timeout=5000)
        if i == 0:
            solution.scroll_into_view_if_needed()
            page.screenshot(path=SCREENSHOTS / f"{stem}-solution.png")

    assert not problems["page_errors"], f"{path}: JavaScript errors: {problems['page_errors']}"
    violations = axe_violations(page)
    assert not violations, f"{path}: accessibility violations (axe-core):\n" + "\n".join(violations)
    check_dark_mode(page, path, stem)  # with the solutions open


def check_wide_content(page, path: str) -> None:
    wide = page.evaluate(WIDE_CONTENT_JS)
    assert not wide["math"], f"{path}: display math cut off or widening the page: {wide['math']}"
    assert not wide["tables"], f"{path}: wide tables without a scroll hint: {wide['tables']}"


@pytest.mark.parametrize("path", PAGES)
def test_phone_page(open_phone_page, path):
    """On a phone: the page never scrolls sideways, wide content scrolls in its own box, axe."""
    page, problems = open_phone_page(path)
    if path == PAGES[0]:
        check_start_here(page, path)
    overflow = page.evaluate(PAGE_OVERFLOW_JS)
    assert overflow["scrollWidth"] <= overflow["width"] and not overflow["culprits"], (
        f"{path}: the page scrolls sideways at {PHONE['width']} px "
        f"(scrollWidth {overflow['scrollWidth']}); what sticks out:\n"
        + "\n".join(overflow["culprits"][:10])
    )
    check_wide_content(page, path)
    # Figures keep their proportions when they shrink to the column, and shrink to no less than
    # a third of their display size (a figure drawn wider than ~1000 px is unreadable there).
    for fig in page.evaluate(FIGURES_JS):
        name = fig["src"].rsplit("/", 1)[-1][:12]
        drawn = fig["shownHeight"] / max(fig["shownWidth"], 1)
        stored = fig["naturalHeight"] / max(fig["naturalWidth"], 1)
        assert abs(drawn - stored) <= 0.02 * stored, (
            f"{path}: figure {name} is squashed on a phone ({drawn:.2f} vs {stored:.2f})"
        )
        if fig["styleWidth"]:
            scale = fig["shownWidth"] / fig["styleWidth"]
            assert scale >= 0.33, (
                f"{path}: figure {name} ({fig['styleWidth']:.0f} px wide) shrinks to "
                f"{scale:.0%} on a phone; draw it narrower or split its panels"
            )
    check_phone_solutions(page, path)
    if path != PAGES[0]:
        check_figure_text(page, path)
    # No code block scrolls sideways on a phone (code wraps), open solutions included.
    wide_code = page.evaluate(CODE_OVERFLOW_JS, ALL_CODE)
    assert not wide_code, f"{path}: code blocks scroll sideways on a phone:\n" + "\n".join(
        wide_code
    )
    violations = axe_violations(page)
    assert not violations, f"{path}: accessibility violations on a phone (axe-core):\n" + (
        "\n".join(violations)
    )
    assert not problems["page_errors"], f"{path}: JavaScript errors: {problems['page_errors']}"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(
        path=SCREENSHOTS / f"phone-{Path(path).stem}.png", full_page=FULL_PAGE_SCREENSHOTS
    )
    if path == PAGES[0]:  # from the landing page, on the same page load: the drawers
        check_phone_navigation(page, problems)


MIN_FIGURE_TEXT_PX = 9  # CSS px: the smallest label a reader can read on a phone, unzoomed


def check_figure_text(page, path: str) -> None:
    """No figure's smallest label (tick labels, legends, titles, annotations) is drawn under
    MIN_FIGURE_TEXT_PX tall at phone width. Its size comes from the notebook: make execute records
    each figure's smallest text against the image's width (tools/figure_text.py); the page gives
    the width the phone shows it at. Solutions are open (check_phone_solutions), so every figure
    is on screen."""
    if not (REPO / "chapters" / f"{Path(path).stem}.ipynb").exists():
        return  # a markdown page (the posts, the glossary): no figures drawn by code
    edition = "zh" if path.startswith("zh/") else "en"
    recorded = notebook_facts(Path(path).stem, edition)["text"]
    shown = page.evaluate(FIGURES_JS)
    assert len(shown) == len(recorded), (
        f"{path}: {len(shown)} figures on the page, {len(recorded)} PNG outputs in the notebook"
    )
    small = []
    for number, (fig, text) in enumerate(zip(shown, recorded, strict=True), 1):
        if text is None:
            small.append(f"figure {number}: no text size recorded (run make execute on it)")
            continue
        if text["fraction"] is None:  # no words to read
            continue
        px = text["fraction"] * fig["shownWidth"]
        if px < MIN_FIGURE_TEXT_PX:
            small.append(
                f"figure {number}: {text['min_pt']:g} pt text in a {text['width_in']:.1f}-inch "
                f"figure shown {fig['shownWidth']} px wide is {px:.1f} px tall"
            )
    assert not small, (
        f"{path}: figure labels under {MIN_FIGURE_TEXT_PX} px at {PHONE['width']} px wide "
        "(larger text, or a narrower figure: panels stacked rather than side by side):\n"
        + "\n".join(small)
    )


def check_start_here(page, path: str) -> None:
    """The landing page links the first chapter in the first screen of a phone, before any
    scrolling: a reader who arrives there sees where to start."""
    first = Path(CHAPTERS[0]).name
    link = page.locator(f'article a[href$="{first}.html"]').first
    assert link.count(), f"{path}: no link to {first}"
    box = link.bounding_box()
    assert box and box["y"] + box["height"] <= PHONE["height"], (
        f"{path}: the first link to {first} is {box and round(box['y'])} px down, below the "
        f"first screen ({PHONE['height']} px)"
    )


def check_phone_solutions(page, path: str) -> None:
    """A tap anywhere on a solution's title bar opens it, and the page stays where it is (the
    title's words are no link back to the exercise that would jump away)."""
    solutions = page.locator("article div.solution")
    for i in range(solutions.count()):
        solution = solutions.nth(i)
        title = solution.locator(".admonition-title").first
        body = solution.locator("section, .cell").first
        assert not body.is_visible(), f"{path}: solution {i + 1} is shown before it is opened"
        assert not title.locator("a").count(), f"{path}: solution {i + 1}'s title is a link"
        url = page.url
        # A finger on the words that were the link ("Exercise 3.1 (...)"), as a reader taps.
        words = title.locator(".solution-title-text").first
        words.scroll_into_view_if_needed()
        box = words.bounding_box()
        assert box, f"{path}: solution {i + 1}'s title has no words"
        page.touchscreen.tap(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        body.wait_for(state="visible", timeout=5000)
        assert page.url == url, f"{path}: tapping solution {i + 1}'s title went to {page.url}"


def open_drawer(page, side: str, what: str):
    """Press the one visible ``{side}-toggle`` button; its drawer, closed before, opens."""
    button = page.locator(f"button.{side}-toggle:visible")
    assert button.count() == 1, f"{button.count()} visible buttons for {what}, expected 1"
    drawer = page.locator(f"#pst-{side}-sidebar-modal")
    assert not drawer.is_visible(), f"{what} is open before its button is pressed"
    button.click()
    drawer.wait_for(state="visible", timeout=5000)
    return drawer


def check_phone_navigation(page, problems: dict) -> None:
    """Below desktop width the sidebars are drawers: their buttons must open them, and their
    links must work (pydata-sphinx-theme 0.17 left both buttons dead, its issue #2451). Starts on
    the landing page at phone width (test_phone_page calls it there) and ends on a chapter."""
    # The third chapter of the drawer; where it has sections (folded under it until its toggle
    # opens them), its first section, a page with in-page contents.
    chapters = list(toc_chapters(read_yaml(REPO / "_toc.yml")).items())
    chapter, sections = chapters[min(2, len(chapters) - 1)]
    target = sections[0] if sections else chapter

    # The chapter list is hidden until the menu button opens it.
    drawer = open_drawer(page, "primary", "the chapter list")
    links = drawer.locator(f'a[href$="{Path(chapter).name}.html"]')
    assert links.count() == 1, f"the opened chapter list has no link to {chapter}"
    if sections:
        toggle = links.first.locator("xpath=..").locator("> details > summary")
        assert toggle.count() == 1, f"{chapter}: no toggle for its sections in the drawer"
        name = toggle.get_attribute("aria-label") or ""
        assert links.first.inner_text().strip() in name, f"the sections' toggle is named {name!r}"
        link = drawer.locator(f'a[href$="{Path(target).name}.html"]').first
        assert not link.is_visible(), f"{target} is listed before its chapter's toggle opens it"
        toggle.locator(".toctree-toggle").click()  # the chevron (the summary has no height)
    else:
        link = links.first
    link.click()
    page.wait_for_url(f"**/{target}.html", wait_until="load", timeout=10_000)
    heading = page.locator("article h1").first.inner_text()
    assert heading.strip(), f"{target}: no heading after following the sidebar link"

    # The in-page contents: the secondary drawer, with links to the sections of this page.
    toc = open_drawer(page, "secondary", "the in-page contents")
    sections = toc.locator('a[href^="#"]')
    assert sections.count() >= 3, f"{target}: the in-page contents show {sections.count()} links"
    second = sections.nth(1)
    anchor = second.get_attribute("href")
    second.click()
    page.wait_for_url(f"**/{target}.html{anchor}", timeout=5000)
    assert not problems["page_errors"], f"JavaScript errors: {problems['page_errors']}"


# --- the Chinese edition (中文版, zh/; tools/translate.py) -----------------------------------------

ZH_TOC = read_yaml(REPO / "zh" / "_toc.yml")
ZH_CHAPTERS = [f for f in toc_chapter_files(ZH_TOC) if f.startswith("chapters/")]
ZH_PAGES = [f"{ZH_TOC['root']}.html"] + [f"{c}.html" for c in ZH_CHAPTERS]
CJK = re.compile(r"[\u4e00-\u9fff]")

# The first paragraph of the article with plenty of Chinese in its own text (not in children),
# marked so that the DevTools protocol can ask which fonts drew it.
CJK_PROBE_JS = """() => {
  const own = p => [...p.childNodes].filter(n => n.nodeType === 3).map(n => n.data).join('');
  const p = [...document.querySelectorAll('article p, article td')]
    .find(p => (own(p).match(/[\\u4e00-\\u9fff]/g) || []).length >= 8);
  if (!p) return null;
  p.id = p.id || 'cjk-font-probe';
  const r = p.getBoundingClientRect();
  return {id: p.id, text: own(p), width: r.width, height: r.height};
}"""


@functools.cache
def cjk_font_families() -> frozenset[str]:
    """The installed font families that cover Chinese, as fontconfig reports them."""
    try:
        listing = subprocess.run(
            ["fc-list", ":lang=zh", "family"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return frozenset()
    return frozenset(name.strip() for line in listing.splitlines() for name in line.split(","))


def fonts_drawing(page, element_id: str) -> list[dict]:
    """The platform fonts Chromium used for an element's own text, with their glyph counts."""
    cdp = page.context.new_cdp_session(page)
    try:
        cdp.send("DOM.enable")
        cdp.send("CSS.enable")
        root = cdp.send("DOM.getDocument", {"depth": 0})["root"]["nodeId"]
        node = cdp.send("DOM.querySelector", {"nodeId": root, "selector": f"#{element_id}"})
        return cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node["nodeId"]})["fonts"]
    finally:
        cdp.detach()


def check_chinese_glyphs(page, path: str) -> None:
    """Chinese text is drawn by a font that has its glyphs (not as empty boxes, "tofu")."""
    families = cjk_font_families()
    if not families:
        skip_or_fail("no font covering Chinese (apt-get install fonts-noto-cjk; needs fc-list)")
    probe = page.evaluate(CJK_PROBE_JS)
    assert probe, f"{path}: no paragraph of Chinese text in the article"
    assert probe["width"] > 0 and probe["height"] > 0, f"{path}: the Chinese text is not drawn"
    fonts = fonts_drawing(page, probe["id"])
    chinese = len(CJK.findall(probe["text"]))
    drawn = sum(f["glyphCount"] for f in fonts if f["familyName"] in families)
    assert drawn >= chinese, (
        f"{path}: {chinese} Chinese characters, {drawn} glyphs from a Chinese font; fonts used: "
        f"{[(f['familyName'], f['glyphCount']) for f in fonts]}"
    )


def check_chinese_figures(page, path: str) -> None:
    """Every figure whose English drawing has words is drawn in Chinese on the Chinese page: the
    PNG the page serves names the texts drawn into it (its Description chunk, written by
    tools/figure_text.py from the figure's own text objects); it has Chinese, and none of the
    English drawing's words is left as it was, unless the notebook's table keeps it (a name such
    as softmax). The worked example 猫吃鱼 is drawn with its Chinese tokens."""
    from io import BytesIO

    from PIL import Image

    stem = Path(path).stem
    table = translation_files.load_figure_labels(stem) or {}
    english = notebook_facts(stem)["text"]
    shown = page.evaluate(FIGURES_JS)
    assert len(shown) == len(english), (
        f"{path}: {len(shown)} figures, {len(english)} in the notebook"
    )
    labels = []
    for number, (fig, text) in enumerate(zip(shown, english, strict=True), 1):
        words = translation_figures.figure_words(text)
        if not words:
            labels.append([])
            continue
        response = page.request.get(urljoin(page.url, fig["src"]))
        assert response.ok, f"{path}: figure {number} ({fig['src']}): HTTP {response.status}"
        description = Image.open(BytesIO(response.body())).text.get("Description")
        assert description, f"{path}: figure {number} is the English drawing (no Chinese labels)"
        drawn = json.loads(description)
        left = [s for s in words if s in drawn and figure_text.translate(s, table) != s]
        assert not left, f"{path}: figure {number} still draws {left} in English"
        assert any(CJK.search(s) for s in drawn), f"{path}: figure {number}: no Chinese {drawn}"
        labels.append(drawn)
    if stem == "01_2_cat_eats_fish":
        assert {"猫", "吃", "鱼"} <= set(labels[0]), f"{path}: figure 1 draws {labels[0]}"


def zh_counterpart(path: str) -> str:
    """The English page that a Chinese page's language switch opens."""
    english = [f"{read_yaml(REPO / '_toc.yml')['root']}.html"] + [f"{c}.html" for c in CHAPTERS]
    return path if path in english else english[0]


def switch_target(page, site: str) -> str:
    switch = page.locator("a.language-switch")
    assert switch.count() == 1, f"{switch.count()} language switches on {page.url}"
    href = switch.get_attribute("href")
    return urljoin(page.url, href).removeprefix(site)


@pytest.mark.parametrize("path", ZH_PAGES)
def test_chinese_page(open_page, site, path):
    """A page of the Chinese edition: Chinese glyphs, typeset math, the English notebook's
    exercises with folded solutions, Colab opening the Chinese notebook, the language switch."""
    assert (HTML / "zh" / path).exists(), f"zh/{path} is not in the built book (make book)"
    page, problems = open_page(f"zh/{path}")
    assert page.evaluate("() => document.documentElement.lang") == "zh-CN"
    h1 = page.locator("article h1").first.inner_text()
    stem = Path(path).stem
    untranslated = page.locator("article .admonition.note", has_text="本章尚未译成中文").count()
    assert untranslated or CJK.search(h1), f"zh/{path}: the title {h1!r} is not Chinese"
    check_chinese_glyphs(page, f"zh/{path}")
    if stem != "glossary":
        check_math(page, f"zh/{path}", problems)
    if f"chapters/{stem}" in NOTEBOOK_CHAPTERS:
        facts = notebook_facts(stem)
        assert page.locator("article div.exercise").count() == facts["exercises"]
        solutions = page.locator("article div.solution")
        assert solutions.count() == facts["solutions"], f"zh/{path}: solutions missing"
        for i in range(solutions.count()):
            body = solutions.nth(i).locator("section, .cell").first
            assert not body.is_visible(), f"zh/{path}: solution {i + 1} is not folded"
        hrefs = set(
            page.eval_on_selector_all(
                'a[href^="https://colab.research.google.com/"]', "els => els.map(e => e.href)"
            )
        )
        expected = colab_url(stem).replace("/chapters/", "/zh/chapters/")
        assert hrefs == {expected}, f"zh/{path}: Colab links {hrefs}, expected {expected}"
        if not untranslated:
            check_chinese_figures(page, f"zh/{path}")
    assert switch_target(page, site) == zh_counterpart(path)
    assert not problems["page_errors"], f"zh/{path}: JavaScript errors: {problems['page_errors']}"
    violations = axe_violations(page)
    assert not violations, f"zh/{path}: accessibility violations (axe-core):\n" + "\n".join(
        violations
    )
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / f"zh-{stem}.png")


@pytest.mark.parametrize("path", ZH_PAGES)
def test_chinese_page_on_a_phone(open_phone_page, path):
    """Chinese lines break anywhere, but code and math inside them must not widen the page; the
    figures' Chinese labels are as large as check_figure_text asks."""
    page, problems = open_phone_page(f"zh/{path}")
    if path == ZH_PAGES[0]:
        check_start_here(page, f"zh/{path}")
    else:  # the Chinese drawings' labels are as readable as the English ones
        check_phone_solutions(page, f"zh/{path}")
        check_figure_text(page, f"zh/{path}")
    overflow = page.evaluate(PAGE_OVERFLOW_JS)
    assert overflow["scrollWidth"] <= overflow["width"] and not overflow["culprits"], (
        f"zh/{path}: the page scrolls sideways at {PHONE['width']} px; what sticks out:\n"
        + "\n".join(overflow["culprits"][:10])
    )
    check_wide_content(page, f"zh/{path}")


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
# Page chrome that must not open a result's snippet (the article header's buttons and contents).
CHROME = re.compile(r"\.ipynb|\.pdf|\bContents\b|目录|Suggest edit|Launch")


@pytest.mark.parametrize("edition", sorted(SEARCHES))
def test_search_finds_the_page_of_each_term(open_page, edition):
    """The search page lists the page that teaches each term, with a snippet of article text."""
    prefix = "zh/" if edition == "zh" else ""
    missed, chrome = [], []
    for term, stem in SEARCHES[edition].items():
        page, problems = open_page(f"{prefix}search.html?q={quote(term)}")
        # Sphinx appends the results one by one, then says how many it found.
        page.wait_for_function(
            "() => { const p = document.querySelector('#search-results p.search-summary');"
            " return p && p.textContent.trim(); }",
            timeout=30_000,
        )
        # Each result's snippet is fetched from its page after the result is listed.
        page.wait_for_function(
            "() => [...document.querySelectorAll('#search-results ul.search li')].slice(0, 5)"
            ".every(li => li.querySelector('p.context'))",
            timeout=30_000,
        )
        results = page.eval_on_selector_all(
            "#search-results ul.search li",
            "els => els.map(e => [e.querySelector('a').href, "
            "(e.querySelector('p.context') || {textContent: ''}).textContent])",
        )
        hrefs = [urlparse(href).path for href, _ in results]
        if not any(h.endswith(f"{prefix}chapters/{stem}.html") for h in hrefs):
            missed.append(f"{term!r}: {stem} not among {len(hrefs)} results {hrefs[:5]}")
        chrome += [
            f"{term!r}: {text[:80]!r}" for _, text in results[:5] if CHROME.search(text[:80])
        ]
        assert not problems["page_errors"], f"{term!r}: JavaScript errors {problems['page_errors']}"
        page.close()
    assert not missed, f"{edition} search:\n" + "\n".join(missed)
    assert not chrome, f"{edition} search snippets begin with page chrome:\n" + "\n".join(chrome)


# English interface strings that a Chinese page must not show (tools/sphinx_zh.py, translate.py).
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


def test_chinese_interface_and_checker_output(open_page, open_phone_page):
    """A Chinese page speaks zh_CN around the article too, its checker lines are Chinese, and
    "Suggest edit" opens the translation file, not the generated notebook."""
    stem = "01_2_cat_eats_fish"
    page, problems = open_page(f"zh/chapters/{stem}.html")
    article = page.locator("article").first.text_content()
    assert "✓ check_seed_head_fix：正确——" in article, "the checker line is not Chinese"
    assert ": correct — " not in article, "an English checker line on a Chinese page"
    shown = page.evaluate(
        """() => [document.body.innerText,
                  ...[...document.querySelectorAll('*')]
                     .map(e => ['title', 'aria-label', 'data-bs-title', 'data-bs-original-title']
                                .map(a => e.getAttribute(a) || '').join(' ')),
                  toggleHintShow, toggleHintHide].join('\\n')"""
    )
    english = [s for s in ENGLISH_CHROME if s in shown]
    assert not english, f"zh/chapters/{stem}: English interface strings {english}"
    assert "打印为 PDF" in shown and "点击显示" in shown
    edit = page.eval_on_selector_all(
        'a[href*="/edit/"]', "els => els.map(e => e.getAttribute('href'))"
    )
    assert edit and all(h.endswith(f"/i18n/zh/{stem}.yml") for h in edit), edit
    assert not problems["page_errors"], problems["page_errors"]
    # On a phone, a wide table's hint is Chinese.
    phone, _ = open_phone_page("zh/chapters/index.html")
    hints = phone.eval_on_selector_all(".book-scroll-hint", "els => els.map(e => e.textContent)")
    assert all(CJK.search(h) for h in hints), hints
