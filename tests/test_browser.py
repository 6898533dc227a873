"""The built book, as a reader sees it: every page of both editions rendered in headless Chromium.

Needs `make book` (the HTML in _build/html), Debian's `chromium` (or CHROMIUM=/path/to/chrome)
and a local MathJax 3 and axe-core from `npm ci` (node_modules/). The book loads MathJax from its
CDN; here that request is answered from the local copy, so the test really checks typeset math,
offline. Any other request that leaves localhost is blocked.

What the HTML alone shows (links and anchors, alt text, captions, folded solutions, the Colab and
language links, each script once, the Chinese figures' labels, the search index) is checked
without a browser by tests/test_book_html.py. This file checks what needs one, on ONE load of
each page at phone width (390 x 844, touch): math typeset, images loaded, nothing scrolling the
page sideways, wide formulas and tables scrolling in their own box, code wrapping, figures in
proportion and readable (no label under 9 px) and sharp, solutions folded and opening on a tap,
Chinese drawn by a CJK font, axe-core finding no critical or serious accessibility violation,
then on the same load dark mode (the reader's system switched to dark, the theme following it,
axe's colour rules run again), and on the landing page the phone's navigation drawers. A sample
of pages that covers every template (landing page, an opening page, a section with figures,
exercises and math, the posts, the glossary; in both editions) is also loaded at desktop width
(code cells that fit the column, solutions opening, axe, dark mode, the Chinese interface), and
a few search terms per edition are typed into a page's search field (the static test queries
the index for all of them). Any console error or uncaught exception on any page fails.

axe and the screenshots run on the page at rest (web fonts loaded, transitions and animations
ended: see settle()).

Locally a missing prerequisite skips the test; with the environment variable CI set it fails.
Screenshots land in _build/screenshots/: phone-*.png (English pages on a phone), zh-*.png
(Chinese pages on a phone), dark-*.png (dark mode, dark-zh-* for Chinese), desktop-*.png (the
desktop sample): the first screen of each page, or the whole page with BOOK_SCREENSHOTS=full.
With BOOK_STEP_TIMES=1 the seconds spent in each step (load, math, axe, ...) are printed at the
end.
"""

from __future__ import annotations

import contextlib
import functools
import mimetypes
import os
import re
import subprocess
import threading
import time
from collections import defaultdict
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import nbformat
import pytest
from conftest import REPO, read_yaml, skip_or_fail, toc_chapters
from test_book_html import (
    ALL_PAGES,
    CHAPTERS,
    CJK,
    ENGLISH_CHROME,
    HTML,
    NOTEBOOK_CHAPTERS,
    ROOT,
    SEARCHES,
    dark_mode_pages,
    notebook_facts,
    widest_code_lines,
)

pytestmark = pytest.mark.browser

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
LANDING = {ROOT, f"zh/{ROOT}"}
# The desktop sample: one page of each template, in both editions (index.html forwards to the
# landing page). The section has figures, exercises with solutions and math.
SECTION = "chapters/01_2_cat_eats_fish.html"
DESKTOP_SAMPLE = [
    "index.html",
    "chapters/01_queries_keys_values.html",
    SECTION,
    "chapters/posts.html",
    "chapters/glossary.html",
]
DESKTOP_SAMPLE += [f"zh/{p}" for p in DESKTOP_SAMPLE]
# The site's index.html (each edition's) forwards to its landing page.
FORWARDS = {"index.html": ROOT, "zh/index.html": f"zh/{ROOT}"}
# Search: a few terms per edition typed into a real page (tests/test_book_html.py queries the
# index for every term of SEARCHES): two-word and one-character queries, Chinese cut into the
# index's words, Chinese with a Latin word.
SEARCH_SAMPLE = {"en": ["causal mask", "online softmax"], "zh": ["位置编码", "键", "在线softmax"]}
# Chapters 9-11's terms, each glossed with its English at first use: a Chinese reader's search
# finds the section that teaches it.
SEARCH_ZH_SERVING_AND_MODELS = {
    "注意力汇": "10_1_sinks_and_windows",
    "环形注意力": "09_4_across_processes",
    "反量化": "09_3_quantised_cache",
    "前缀缓存": "09_1_paged_cache",
    "连续批处理": "09_1_paged_cache",
    "写时复制": "09_1_paged_cache",
    "门控": "10_2_gated_attention",
}
SEARCH_SAMPLE["zh"] += list(SEARCH_ZH_SERVING_AND_MODELS)

# --- time per step (BOOK_STEP_TIMES=1 prints them) ------------------------------------------------

STEP_TIMES: dict[str, list[float]] = defaultdict(list)


@contextlib.contextmanager
def step(name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        STEP_TIMES[name].append(time.perf_counter() - start)


@pytest.fixture(scope="module", autouse=True)
def step_times():
    yield
    if os.environ.get("BOOK_STEP_TIMES") and STEP_TIMES:
        print("\nseconds per step (count, total, mean):")
        for name, times in sorted(STEP_TIMES.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {name:22} {len(times):4d} {sum(times):8.1f} {sum(times) / len(times):6.2f}")


# --- what the page runs in the browser ------------------------------------------------------------

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
# A page without math does not load MathJax.
MATH_PROBLEMS_JS = """() => {
  const untypeset = [...document.querySelectorAll('.math')]
      .filter(el => !el.querySelector('mjx-container')).map(el => el.textContent.slice(0, 80));
  const broken = [];
  if (window.MathJax && MathJax.startup && MathJax.startup.document) {
    for (const item of MathJax.startup.document.math) {
      const mml = MathJax.startup.toMML(item.root);
      if (/<merror|mathcolor="red"/.test(mml)) broken.push(item.math.slice(0, 80));
    }
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

# The figures of the notebook outputs, as drawn: display size (inline style and on screen) and
# stored size.
FIGURES_JS = """() => [...document.querySelectorAll('article .cell_output img')].map(img => ({
  src: img.getAttribute('src'),
  styleWidth: parseFloat(img.style.width) || 0,
  naturalWidth: img.naturalWidth, naturalHeight: img.naturalHeight,
  shownWidth: img.clientWidth, shownHeight: img.clientHeight}))"""

# Code blocks whose lines do not fit the text column (the block scrolls sideways), with their
# longest line: the code cells (at desktop width; package code shown with literalinclude is 100
# columns wide and scrolls there), or every code block but printed output (on a phone, where
# code wraps). Cells folded away (hidden input, closed solutions) have no box until opened.
CODE_OVERFLOW_JS = """selector => [...document.querySelectorAll(selector)]
  .filter(pre => !pre.closest('.cell_output'))
  .filter(pre => pre.offsetParent !== null && pre.scrollWidth > pre.clientWidth + 1)
  .map(pre => pre.textContent.split('\\n')
                 .reduce((a, b) => (a.length >= b.length ? a : b)).slice(0, 100))"""
# Printed output wider than its box on a phone, other than a printed table under its scroll hint
# (_static/book.js wraps other printed lines and puts the hint above a table that overflows).
OUTPUT_OVERFLOW_JS = """() => [...document.querySelectorAll('article .cell_output pre')]
  .filter(pre => pre.offsetParent !== null && pre.scrollWidth > pre.clientWidth + 1)
  .filter(pre => {
    const box = pre.closest('div.output') || pre.parentNode;
    const hint = box.previousElementSibling;
    return !(pre.classList.contains('book-printed-table') && hint
             && hint.classList.contains('book-scroll-hint') && hint.offsetParent !== null);
  })
  .map(pre => pre.textContent.split('\\n')
                 .reduce((a, b) => (a.length >= b.length ? a : b)).slice(0, 100))"""
CODE_CELLS = "article div.cell_input pre"
ALL_CODE = "article div.highlight pre"

# The given lines, each put into a copy of the page's first visible code cell: those that do not
# fit it (the copy scrolls sideways). The copies are removed again.
CODE_LINES_FIT_JS = """lines => {
  const cell = [...document.querySelectorAll('article div.cell_input')]
    .find(c => c.querySelector('pre') && c.querySelector('pre').offsetParent !== null);
  if (!cell) return null;
  const wide = [];
  for (const line of lines) {
    const copy = cell.cloneNode(true);
    copy.querySelector('pre').textContent = line;
    cell.after(copy);
    const pre = copy.querySelector('pre');
    if (pre.scrollWidth > pre.clientWidth + 1) wide.push(line);
    copy.remove();
  }
  return wide;
}"""

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
    with step("settle"):
        if not page.evaluate("() => !!document.getElementById('book-test-settled')"):
            page.add_style_tag(content=SETTLED_CSS)
            page.evaluate(
                "() => { document.querySelector('style:last-of-type').id = 'book-test-settled'; }"
            )
        running = page.evaluate(SETTLE_JS)
    assert not running, f"{page.url}: still animating after settling, axe would race it: {running}"


def axe_violations(page, rules: list[str] | None = None) -> list[str]:
    """Critical and serious axe-core violations on the page, outside AXE_EXCLUDE: of every rule
    axe runs by default, or only of ``rules``."""
    settle(page)
    if not page.evaluate("() => typeof window.axe === 'object'"):
        with step("axe inject"):
            page.add_script_tag(content=axe_source())
    with step("axe colours" if rules else "axe"):
        return page.evaluate(
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


@functools.cache
def axe_source() -> str:
    return AXE_JS.read_text(encoding="utf-8")


def check_axe(page, path: str, where: str) -> None:
    violations = axe_violations(page)
    assert not violations, f"{path}: accessibility violations {where} (axe-core):\n" + (
        "\n".join(violations)
    )


# The axe rules that read colours: all that dark mode can change (the theme swaps colours by CSS
# variables under [data-theme=dark]; markup, names and layout stay the same).
COLOUR_RULES = ["color-contrast", "link-in-text-block"]


def check_dark_mode(page, path: str, shot: str) -> None:
    """Switch the reader's system to dark mode on the loaded page; the theme follows it, and
    axe's colour rules find nothing critical or serious in dark mode either."""
    try:
        with step("dark switch"):
            page.emulate_media(color_scheme="dark")
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
    screenshot(page, f"dark-{shot}")


def screenshot(page, name: str) -> None:
    """The first screen of the page (the whole page with BOOK_SCREENSHOTS=full)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with step("screenshot"):
        if not FULL_PAGE_SCREENSHOTS:  # instantly (the theme scrolls smoothly: ~1 s)
            page.evaluate("() => window.scrollTo({top: 0, left: 0, behavior: 'instant'})")
        page.screenshot(path=SCREENSHOTS / f"{name}.png", full_page=FULL_PAGE_SCREENSHOTS)


# --- the site, the browser and the pages ----------------------------------------------------------


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


class Tab:
    """One browser tab at a viewport, kept for the module and taken from page to page.

    Each page is opened by navigating this tab: a fresh context per page made Chromium parse the
    theme's stylesheets and compile its scripts again for every load (about a second more per
    page on 2 cores). What a page could leave behind is reset before the next is opened: the
    colour scheme goes back to light; the theme stores nothing unless a reader clicks its switch,
    which no test does. Console errors, uncaught exceptions and the MathJax files fetched are
    recorded into the problems of the page being opened.
    """

    def __init__(self, browser, site: str, viewport: dict, **options) -> None:
        self.site = site
        with step("context"):
            self.context = browser.new_context(viewport=viewport, **options)
        self.problems: dict[str, list[str]] = self.no_problems()
        self.context.route("**/*", self.route)
        # axe-core in every page the tab opens, before the page's own scripts (compiled once
        # for the tab, not injected after each load).
        self.context.add_init_script(script=axe_source())
        self.page = self.new_page()

    @staticmethod
    def no_problems() -> dict[str, list[str]]:
        return {"mathjax_missing": [], "errors": [], "blocked": []}

    def new_page(self):
        page = self.context.new_page()
        page.on("console", self.console)
        page.on("pageerror", lambda exc: self.problems["errors"].append(f"uncaught: {exc}"))
        return page

    def route(self, r) -> None:
        url = r.request.url
        if url.startswith(self.site):
            r.continue_()
        elif url.startswith(MATHJAX_CDN):
            local = MATHJAX_LOCAL / urlparse(url).path.removeprefix(urlparse(MATHJAX_CDN).path)
            if local.is_file():
                ctype = mimetypes.guess_type(local.name)[0] or "application/octet-stream"
                r.fulfill(status=200, body=local.read_bytes(), headers={"Content-Type": ctype})
            else:
                self.problems["mathjax_missing"].append(url)
                r.fulfill(status=404, body="")
        else:
            self.problems["blocked"].append(url)
            r.abort()

    def console(self, message) -> None:
        if message.type == "error":
            where = message.location.get("url", "") if message.location else ""
            self.problems["errors"].append(f"console error: {message.text} ({where})")

    def open(self, path: str, redirects_to: str | None = None):
        """(page, problems): ``path`` loaded in the tab, MathJax finished."""
        if self.page.is_closed():  # a test closed it, or the tab crashed
            self.page = self.new_page()
        page, site = self.page, self.site
        page.emulate_media(color_scheme="light")  # the page before may have switched to dark
        self.problems = problems = self.no_problems()
        with step("load"):
            response = page.goto(site + path, wait_until="load")
            assert response is not None and response.ok, (
                f"{path}: HTTP {response and response.status}"
            )
            if redirects_to:
                page.wait_for_url(site + redirects_to, wait_until="load", timeout=10_000)
        if page.locator(".math").count():
            with step("mathjax"):
                page.wait_for_function(
                    "() => window.MathJax && MathJax.startup && MathJax.startup.promise"
                )
                page.evaluate("() => MathJax.startup.promise.then(() => true)")
        return page, problems

    def close(self) -> None:
        self.context.close()


@pytest.fixture(scope="module")
def desktop_tab(browser, site):
    tab = Tab(browser, site, DESKTOP)
    yield tab
    tab.close()


@pytest.fixture(scope="module")
def phone_tab(browser, site):
    tab = Tab(browser, site, PHONE, is_mobile=True, has_touch=True)  # 390 x 844, mobile layout
    yield tab
    tab.close()


@pytest.fixture
def open_page(desktop_tab):
    """open_page(path) -> (page, problems): the page loaded at desktop width, MathJax finished,
    problems (console errors, uncaught exceptions, missing MathJax files) recorded."""
    return desktop_tab.open


@pytest.fixture
def open_phone_page(phone_tab):
    """open_page at a phone's viewport (390 x 844, touch, mobile layout)."""
    return phone_tab.open


def assert_no_errors(path: str, problems: dict) -> None:
    """No script error, console error or missing MathJax file on the page (or the pages it led
    to)."""
    assert not problems["errors"], f"{path}: errors in the browser:\n" + "\n".join(
        problems["errors"]
    )
    assert not problems["mathjax_missing"], (
        f"{path}: MathJax files missing locally: {problems['mathjax_missing']}"
    )


def source_has_math(path: str) -> bool:
    """Whether the page's source writes math: a chapter's markdown cells, or a markdown page."""
    stem = Path(path).stem
    notebook = REPO / "chapters" / f"{stem}.ipynb"
    if notebook.exists():
        nb = nbformat.read(notebook, as_version=4)
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    else:
        folder = REPO / "zh" if path.startswith("zh/") else REPO
        page = folder / "chapters" / f"{stem}.md"
        text = page.read_text(encoding="utf-8") if page.exists() else ""
    return bool(re.search(r"\$[^$\n]+\$|\$\$|\{math\}|\\begin\{", text))


def check_math(page, path: str) -> None:
    with step("check math"):
        math = page.evaluate(MATH_PROBLEMS_JS)
        leftover = RAW_TEX.findall(page.evaluate(ARTICLE_TEXT_JS))
    if source_has_math(path):  # an opening page of sections may have none
        assert math["count"] > 0, f"{path}: no math typeset by MathJax (no mjx-container)"
    assert not math["untypeset"], f"{path}: math left untypeset: {math['untypeset']}"
    assert math["errors"] == 0 and not math["broken"], f"{path}: MathJax errors in {math['broken']}"
    assert not leftover, f"{path}: raw TeX in the page text: {leftover[:10]}"


def check_images_load(page, path: str) -> None:
    with step("images"):
        images = page.evaluate(IMAGES_JS)
    broken = [img["src"] for img in images if img["width"] == 0]
    assert not broken, f"{path}: images that did not load: {broken}"


def check_wide_content(page, path: str) -> None:
    with step("layout checks"):
        wide = page.evaluate(WIDE_CONTENT_JS)
    assert not wide["math"], f"{path}: display math cut off or widening the page: {wide['math']}"
    assert not wide["tables"], f"{path}: wide tables without a scroll hint: {wide['tables']}"


def check_no_sideways_scroll(page, path: str) -> None:
    with step("layout checks"):
        overflow = page.evaluate(PAGE_OVERFLOW_JS)
    assert overflow["scrollWidth"] <= overflow["width"] and not overflow["culprits"], (
        f"{path}: the page scrolls sideways at {PHONE['width']} px "
        f"(scrollWidth {overflow['scrollWidth']}); what sticks out:\n"
        + "\n".join(overflow["culprits"][:10])
    )


def check_code_fits(page, path: str, selector: str, where: str) -> None:
    with step("layout checks"):
        wide_code = page.evaluate(CODE_OVERFLOW_JS, selector)
    assert not wide_code, f"{path}: code blocks scroll sideways {where}:\n" + "\n".join(wide_code)


def check_printed_output(page, path: str) -> None:
    """On a phone no printed line runs off the right edge unseen: it wraps, or it is a printed
    table that scrolls in its box under a hint saying so."""
    with step("layout checks"):
        wide = page.evaluate(OUTPUT_OVERFLOW_JS)
    assert not wide, f"{path}: printed output runs off the right edge with no hint:\n" + (
        "\n".join(wide)
    )


def check_phone_figures(page, path: str) -> None:
    """Figures keep their proportions when they shrink to the column, shrink to no less than a
    third of their display size (a figure drawn wider than ~1000 px is unreadable there), and
    are stored at twice their display width (sharp on high-density screens)."""
    for fig in page.evaluate(FIGURES_JS):
        name = fig["src"].rsplit("/", 1)[-1][:12]
        drawn = fig["shownHeight"] / max(fig["shownWidth"], 1)
        stored = fig["naturalHeight"] / max(fig["naturalWidth"], 1)
        assert abs(drawn - stored) <= 0.02 * stored, (
            f"{path}: figure {name} is squashed on a phone ({drawn:.2f} vs {stored:.2f})"
        )
        assert fig["styleWidth"] and fig["naturalWidth"] >= 1.9 * fig["styleWidth"], (
            f"{path}: figure {name} is stored at {fig['naturalWidth']} px for a display width "
            f"of {fig['styleWidth']} px: not sharp on a high-density screen"
        )
        scale = fig["shownWidth"] / fig["styleWidth"]
        assert scale >= 0.33, (
            f"{path}: figure {name} ({fig['styleWidth']:.0f} px wide) shrinks to "
            f"{scale:.0%} on a phone; draw it narrower or split its panels"
        )


MIN_FIGURE_TEXT_PX = 9  # CSS px: the smallest label a reader can read on a phone, unzoomed


def check_figure_text(page, path: str) -> None:
    """No figure's smallest label (tick labels, legends, titles, annotations) is drawn under
    MIN_FIGURE_TEXT_PX tall at phone width. Its size comes from the notebook: make execute records
    each figure's smallest text against the image's width (tools/figure_text.py; the static test
    checks that every figure has it); the page gives the width the phone shows it at. Solutions
    are open (check_phone_solutions), so every figure is on screen."""
    chapter = f"chapters/{Path(path).stem}"
    if chapter not in NOTEBOOK_CHAPTERS:
        return  # a markdown page (the posts, the glossary): no figures drawn by code
    edition = "zh" if path.startswith("zh/") else "en"
    recorded = notebook_facts(Path(path).stem, edition)["text"]
    shown = page.evaluate(FIGURES_JS)
    assert len(shown) == len(recorded), (
        f"{path}: {len(shown)} figures on the page, {len(recorded)} PNG outputs in the notebook"
    )
    small = []
    for number, (fig, text) in enumerate(zip(shown, recorded, strict=True), 1):
        if text is None or text["fraction"] is None:  # none recorded (the static test fails
            continue  # that), or no words to read
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


def check_language_switch_label(page, path: str) -> None:
    """On a phone the language switch says in words where it goes (中文 on an English page, EN on
    a Chinese one), not with an icon alone."""
    switch = page.locator("a.language-switch").first
    assert switch.is_visible(), f"{path}: no visible language switch on a phone"
    label = switch.inner_text().strip()
    expected = "EN" if path.startswith("zh/") else "中文"
    assert label == expected, (
        f"{path}: the language switch reads {label!r} on a phone, not {expected!r}"
    )


def check_phone_solutions(page, path: str) -> None:
    """Each solution is folded, and a tap anywhere on its title bar opens it, and the page stays
    where it is (the title's words are no link back to the exercise that would jump away)."""
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


def check_phone_navigation(page, prefix: str) -> None:
    """Below desktop width the sidebars are drawers: their buttons must open them, and their
    links must work (pydata-sphinx-theme 0.17 left both buttons dead, its issue #2451). Starts on
    a landing page at phone width and ends on a chapter."""
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
    page.wait_for_url(f"**/{prefix}{target}.html", wait_until="load", timeout=10_000)
    heading = page.locator("article h1").first.inner_text()
    assert heading.strip(), f"{target}: no heading after following the sidebar link"

    # The in-page contents: the secondary drawer, with links to the sections of this page.
    toc = open_drawer(page, "secondary", "the in-page contents")
    sections_here = toc.locator('a[href^="#"]')
    assert sections_here.count() >= 3, (
        f"{target}: the in-page contents show {sections_here.count()} links"
    )
    second = sections_here.nth(1)
    anchor = second.get_attribute("href")
    second.click()
    page.wait_for_url(f"**/{prefix}{target}.html{anchor}", timeout=5000)


# --- Chinese text -------------------------------------------------------------------------------

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


def check_chinese_interface(page, path: str) -> None:
    """A Chinese page speaks zh_CN around the article once its scripts ran (_static/book.js
    renames the theme's English toggles): no English interface string in the text, tooltips and
    accessible names, nor in sphinx-togglebutton's hints; the wide tables' hints are Chinese."""
    shown = page.evaluate(
        """() => [document.body.innerText,
                  ...[...document.querySelectorAll('*')]
                     .map(e => ['title', 'aria-label', 'data-bs-title', 'data-bs-original-title']
                                .map(a => e.getAttribute(a) || '').join(' ')),
                  toggleHintShow, toggleHintHide].join('\\n')"""
    )
    english = [s for s in ENGLISH_CHROME if s in shown]
    assert not english, f"{path}: English interface strings {english}"
    assert "打印为 PDF" in shown and "点击显示" in shown, (
        f"{path}: Chinese interface strings missing"
    )
    check_chinese_hints(page, path)


def check_chinese_hints(page, path: str) -> None:
    hints = page.eval_on_selector_all(".book-scroll-hint", "els => els.map(e => e.textContent)")
    assert all(CJK.search(h) for h in hints), f"{path}: wide-table hints not in Chinese: {hints}"


# --- the tests ------------------------------------------------------------------------------------


def shot_name(path: str) -> str:
    stem = Path(path).stem
    return f"zh-{stem}" if path.startswith("zh/") else stem


@pytest.mark.parametrize("path", ALL_PAGES)
def test_page_on_a_phone(open_phone_page, path):
    """One load of each page of both editions at phone width: typeset math, images loaded, no
    sideways scrolling, wide content scrolling in its own box, code and printed lines that wrap
    (printed tables scroll under a hint), the language switch labelled, figures in
    proportion, sharp and readable, solutions folded until tapped, Chinese glyphs, axe, the
    navigation drawers from the landing pages, and no script error; and axe's colour rules in
    dark mode on the pages that hold every kind of element of their edition between them
    (test_book_html.dark_mode_pages)."""
    page, problems = open_phone_page(path)
    chinese = path.startswith("zh/")
    check_math(page, path)
    check_images_load(page, path)
    if chinese:
        with step("chinese glyphs"):
            check_chinese_glyphs(page, path)
            check_chinese_hints(page, path)
    if path in LANDING:
        check_start_here(page, path)
    check_language_switch_label(page, path)
    check_no_sideways_scroll(page, path)
    check_wide_content(page, path)
    with step("figures and solutions"):
        check_phone_figures(page, path)
        check_phone_solutions(page, path)
        check_figure_text(page, path)
    # No code block scrolls sideways on a phone (code wraps), open solutions included.
    check_code_fits(page, path, ALL_CODE, "on a phone")
    check_printed_output(page, path)
    check_axe(page, path, "on a phone")
    screenshot(page, f"phone-{shot_name(path)}" if not chinese else shot_name(path))
    if path in dark_mode_pages():  # the pages that hold every kind of element between them
        check_dark_mode(page, path, shot_name(path))
    if path in LANDING:  # on the same page load: the drawers
        with step("navigation"):
            check_phone_navigation(page, "zh/" if chinese else "")
    assert_no_errors(path, problems)


@pytest.mark.parametrize("path", DESKTOP_SAMPLE)
def test_page_at_desktop(open_page, path):
    """A page of each template at desktop width: typeset math, wide content, code cells that fit
    the column (and the widest lines of every chapter's code fit a code cell), solutions that
    open, the Chinese interface, axe in light and dark mode, and no script error."""
    chinese = path.startswith("zh/")
    forward = FORWARDS.get(path)
    page, problems = open_page(path, redirects_to=forward)
    shown_path = forward or path
    check_math(page, shown_path)
    check_images_load(page, shown_path)
    check_wide_content(page, shown_path)
    # Code cells fit the text column: chapter code is written to fit it.
    check_code_fits(page, shown_path, CODE_CELLS, "at desktop width")
    if shown_path == SECTION:  # the widest lines of all the chapters' code cells, shown here
        wide = page.evaluate(CODE_LINES_FIT_JS, widest_code_lines())
        assert wide == [], f"code lines wider than a code cell at desktop width: {wide}"
    if chinese:
        check_chinese_interface(page, shown_path)
    screenshot(page, f"desktop-{shot_name(shown_path)}")
    solutions = page.locator("article div.solution")
    for i in range(solutions.count()):
        solution = solutions.nth(i)
        body = solution.locator("section, .cell").first
        assert not body.is_visible(), f"{path}: solution {i + 1} is shown before it is opened"
        # The chevron button; the title itself also holds a link to the exercise.
        solution.locator("button.toggle-button").first.click()
        body.wait_for(state="visible", timeout=5000)
        if i == 0:
            solution.scroll_into_view_if_needed()
            page.screenshot(path=SCREENSHOTS / f"desktop-{shot_name(shown_path)}-solution.png")
    check_axe(page, shown_path, "at desktop width")
    check_dark_mode(page, shown_path, f"desktop-{shot_name(shown_path)}")  # solutions open
    assert_no_errors(path, problems)


# Page chrome that must not open a result's snippet (the article header's buttons and contents).
CHROME = re.compile(r"\.ipynb|\.pdf|\bContents\b|目录|Suggest edit|Launch")


@pytest.mark.parametrize("edition", sorted(SEARCH_SAMPLE))
def test_search_typed_into_a_page(open_page, edition):
    """A reader types a term into the search field (first on the landing page, then on the
    results page): the results list the page that teaches it, each with a snippet of article
    text, not of the page's buttons."""
    prefix = "zh/" if edition == "zh" else ""
    page, problems = open_page(f"{prefix}{ROOT}")
    missed, chrome = [], []
    for term in SEARCH_SAMPLE[edition]:
        stem = {**SEARCHES[edition], **SEARCH_ZH_SERVING_AND_MODELS}[term]
        with step("search"):
            if "search.html" not in page.url:
                page.keyboard.press("Control+k")  # the theme's search dialog
            field = page.locator('form input[name="q"]:visible').first
            field.fill(term)
            with page.expect_navigation(wait_until="load"):
                field.press("Enter")
            query = parse_qs(urlparse(page.url).query).get("q")
            assert urlparse(page.url).path.endswith("search.html") and query == [term], (
                f"typing {term!r} into the search field opened {page.url}"
            )
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
    assert not missed, f"{edition} search:\n" + "\n".join(missed)
    assert not chrome, f"{edition} search snippets begin with page chrome:\n" + "\n".join(chrome)
    assert_no_errors(f"{prefix}search.html", problems)
