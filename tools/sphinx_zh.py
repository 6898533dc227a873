"""Sphinx extension for the Chinese book (zh/): search, interface strings and edit links.

tools/translate.py writes it into zh/_config.yml; the English book does not load it.

**Search.** Sphinx's Chinese search language (`html_search_language: zh`) cuts the text into words with
jieba when it builds the index, but it drops every one-character word (键, 值, 头 never reach the
index), and the browser splits a query only at spaces and punctuation: 位置编码 is looked up as one
word, while the index holds 位置 and 编码. This extension fixes both ends:

* the index keeps one-character Chinese words, except a few particles (的, 了, …);
* the query is cut into the longest words the index knows, left to right (forward maximum
  matching with the index's own vocabulary, which jieba made): 位置编码 -> 位置 编码,
  头维度 -> 头 维度. A Chinese character that the index lacks (a particle) is left out, as a
  stop word is. Latin words are split as Sphinx splits them.

**Interface strings.** The themes' Chinese catalogues leave some strings English ("Suggest edit",
"Color mode", "Link to this heading" ...) and translate "Print to PDF" the Taiwan way (列印成 PDF);
INTERFACE puts zh_CN wording in front of every catalogue. (The strings set by configuration, such
as sphinx-togglebutton's "Click to show" and myst-nb's "Show code cell source", are in
tools/translation_book.py's chinese_config; the wide-table hint is in _static/book.js.)

**Edit links.** A Chinese page is generated: "Suggest edit" opens its translation file,
`i18n/zh/<stem>.yml` (the glossary page: `i18n/zh/glossary.yml`), not the generated notebook.
"""

from __future__ import annotations

import re
from gettext import GNUTranslations, NullTranslations
from pathlib import Path

import jieba
from sphinx import locale
from sphinx.search import languages
from sphinx.search.zh import SearchChinese

HAN = re.compile(r"^[\u3400-\u4dbf\u4e00-\u9fff]$")
# One-character words that carry no meaning of their own in a query.
PARTICLES = frozenset("的了和与及或是在也就都而把被这那个之其着过吗呢吧啊")

# Replaces searchtools.js's splitQuery (Sphinx puts it into language_data.js). Search._index is
# loaded before a query is parsed (Search.query runs once the index is there).
SPLITTER = r"""
var splitQuery = (query) => {
  const index = (typeof Search !== "undefined" && Search._index) || {};
  const terms = index.terms || {};
  const titles = index.titleterms || {};
  const known = (w) => terms.hasOwnProperty(w) || titles.hasOwnProperty(w);
  const words = [];
  query.split(/[^\p{Letter}\p{Number}_\p{Emoji_Presentation}]+/gu).forEach((token) => {
    token.split(/(\p{Script=Han}+)/u).forEach((run) => {
      if (!run) return;
      if (!/\p{Script=Han}/u.test(run)) { words.push(run); return; }
      let i = 0;
      while (i < run.length) {
        let j = Math.min(run.length, i + 8);
        while (j > i + 1 && !known(run.slice(i, j))) j--;
        if (j > i + 1 || known(run.slice(i, j))) words.push(run.slice(i, j));
        i = j;
      }
    });
  });
  return words;
};
"""


class SearchChineseWords(SearchChinese):
    """Sphinx's Chinese search, keeping one-character Chinese words and splitting the query."""

    js_splitter_code = SPLITTER

    def init(self, options: dict[str, str]) -> None:
        super().init(options)
        # Sphinx 7.4 keeps every Latin word it has seen in a class-level list and looks each word
        # up in it when stemming: quadratic in the book's length (the Chinese book took 5x the
        # English one to write). A set of this index's own words answers the same question.
        self.latin_terms: set[str] = set()  # type: ignore[assignment]

    def split(self, input: str) -> list[str]:
        chinese = list(jieba.cut_for_search(input))
        latin = [term.strip() for term in self.latin1_letters.findall(input)]
        self.latin_terms.update(latin)
        return chinese + latin

    def word_filter(self, stemmed_word: str) -> bool:
        if HAN.match(stemmed_word):
            return stemmed_word not in PARTICLES
        return super().word_filter(stemmed_word)


# msgid -> simplified Chinese (zh_CN), for every message catalogue (Sphinx, the themes).
INTERFACE = {
    "Print to PDF": "打印为 PDF",
    "Suggest edit": "建议修改",
    "Open issue": "提交问题",
    "Repository": "代码仓库",
    "Source repositories": "源代码仓库",
    "Launch interactive content": "启动交互式内容",
    "Color mode": "颜色模式",
    "System Settings": "跟随系统设置",
    "Light": "亮色",
    "Dark": "暗色",
    "Link to this heading": "指向本标题的链接",
    "Link to this image": "指向本图的链接",
    "Link to this table": "指向本表的链接",
    "Link to this code": "指向本代码的链接",
    "Link to this definition": "指向本定义的链接",
    "Toggle primary sidebar": "显示/隐藏主侧边栏",
    "Toggle secondary sidebar": "显示/隐藏页内目录",
}
# A launch button's tooltip is "Launch on" + " Colab": said whole instead.
LAUNCH_TOOLTIP = "在 {} 中打开"
I18N = Path(__file__).resolve().parents[1] / "i18n" / "zh"
EDIT_SOURCE = re.compile(r"/zh/chapters/([^/?#]+)\.(?:ipynb|md)$")


class _Interface(NullTranslations):
    def gettext(self, message: str) -> str:
        return INTERFACE.get(message, message)


def zh_cn_interface(app) -> None:
    """Put INTERFACE in front of every message catalogue loaded so far."""
    for translator in locale.translators.values():
        if isinstance(translator, GNUTranslations):
            # _catalog: the catalogue's own dict of messages, private, so typeshed leaves it out
            translator._catalog.update(INTERFACE)  # type: ignore[attr-defined]
        else:  # no catalogue of this language: English, unless INTERFACE has it
            translator.add_fallback(_Interface())


def edit_url(url: str) -> str:
    """The generated page's edit link -> its translation file (the English source if none)."""
    m = EDIT_SOURCE.search(url)
    if not m:
        return url
    stem = m.group(1)
    target = (
        f"/i18n/zh/{stem}.yml" if (I18N / f"{stem}.yml").is_file() else f"/chapters/{stem}.ipynb"
    )
    return url[: m.start()] + target


def chinese_buttons(app, pagename, templatename, context, doctree) -> None:
    def fix(buttons):
        for button in buttons:
            if button.get("label") == "source-edit-button":
                button["url"] = edit_url(button["url"])
            tooltip = button.get("tooltip", "")
            if isinstance(tooltip, str) and tooltip.startswith("Launch on "):
                button["tooltip"] = LAUNCH_TOOLTIP.format(tooltip.split()[-1])
            fix(button.get("buttons", []))

    fix(context.get("header_buttons", []))


def setup(app):
    languages["zh"] = SearchChineseWords
    app.connect("builder-inited", zh_cn_interface)
    # After the theme filled the header buttons (its handlers run at the default priority).
    app.connect("html-page-context", chinese_buttons, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
