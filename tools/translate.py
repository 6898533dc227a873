"""The Chinese edition (中文版): translation files, their checks, and the generated Chinese book.

Markdown is translated, with code comments and the words drawn in figures. Per English notebook `chapters/<stem>.ipynb` (a chapter, or a section
of one: every file of _toc.yml, `sections:` included) there is one translation file `i18n/zh/<stem>.yml`; it maps every markdown cell id to its Chinese text, and
every figure cell id to its Chinese alt text and caption, each with `en:`, the first 12 hex digits
of the SHA-256 of the English text it translates (for a figure: alt + "\\n" + caption). When an
English cell changes, its hash no longer matches and the entry is *stale*. The landing page
`chapters/index.md` is translated the same way in `i18n/zh/index.yml`, one entry per `##` section,
and so is every other markdown page of the table of contents (`chapters/posts.md` in
`i18n/zh/posts.yml`); these pages are always checked, listed in `chapters.txt` or not. Beside
`cells:`, a notebook's file may translate code comments (`code:`, per code cell id) and has a
table of the texts its figures draw (`figures:`, English as drawn: Chinese, `{}` a number), from
which make execute draws each figure again in Chinese (tools/figure_text.py).

The glossary is one file, `i18n/zh/glossary.yml`: each term's English, its Chinese, a short English
definition (`define:`) and the label of the section that teaches it (`taught:`). `build` turns it
into two pages, the English glossary `chapters/glossary.md` and the Chinese `zh/chapters/glossary.md`.

    python tools/translate.py todo <stem>   English text of every missing or stale entry (for translators)
    python tools/translate.py stale         list missing, stale and orphaned entries of every file
    python tools/translate.py check         coverage, staleness, MyST structure, glossary; exit 1 on a problem
    python tools/translate.py build         write the Chinese book: zh/_config.yml, zh/_toc.yml,
                                            zh/chapters/*.ipynb, zh/chapters/*.md (index, posts,
                                            glossary); and the English glossary, chapters/glossary.md

Which chapters `check` requires to be fully translated is listed in `i18n/zh/chapters.txt` (plus
the landing page, always); a chapter's sections are listed one by one. Add a stem there when its
translation lands. `build` writes every chapter and section of the English table of contents: a listed chapter from its translation, any other one as
an English copy under a note saying it is not translated yet (so the Chinese book's links resolve;
a draft translation file of an unlisted chapter is ignored until the chapter is listed). A missing
or stale cell falls back to its English text (and `check` fails until it is translated).

The structure rules `check` enforces, cell by cell against the English: the same directive and
option lines (an exercise's title excepted), code and math blocks, `(label)=` targets, heading
levels, list items, table columns, role targets ({ref}, {numref}, {doc}, {eq}, {cite}), inline
math, inline code spans, URLs and link targets; some Chinese text in every cell that has English
prose; and no word that i18n/zh/glossary.yml lists under `avoid`. In math (inline, display, `{math}`
blocks and roles) only the words of `\\text{…}` (`\\textrm`, `\\mbox`) may differ: the same groups,
in the same order, and everything around them byte for byte; the glossary's `avoid` applies to them.

The generated notebooks equal the English ones except for markdown sources, figure alt texts and
captions, the `language` entry of the notebook metadata, `{literalinclude}` paths (one level
deeper: zh/chapters/ instead of chapters/), and in a listed chapter the setup cell (chinese_setup_cell:
Chinese comments, the checkout two folders up, `mha.exercises.set_language("zh")`) and every checker's
success line, replaced by what that checker prints in Chinese (run_checkers: each checker run on an
answer it accepts, in a fresh interpreter, in both languages; the English line must equal the stored
one, else the notebook is stale), comments translated under `code:`, and every figure that draws
English words replaced by its Chinese drawing. Other code cells, outputs, cell ids and tags are
copied.

`check` also enforces, in every listed file: no reduction stated as a multiple (比B少N倍, 缩小N倍,
慢了N倍, 按倍数放慢: translation_glossary.REDUCTION_BY_A_MULTIPLE; code comments included), never
本笔记本 (prose, code comments, the setup cell), the closing heading of every section ("What to take
away") translated 小结, and per chapter (opening page and sections, in reading order) the English in full-width parentheses at
the first use of every glossary term marked `first_use`; every English word drawn in a figure has its
Chinese in `figures:`, each Chinese drawing was made with today's table, and no entry is unused.

The work is shared among modules, each with one job: translation_files.py (the English units and
the files of i18n/zh/), translation_structure.py (the MyST structure a translation keeps),
translation_glossary.py (the glossary's pages and rules), translation_code.py (code comments, the
setup cell, the checkers' lines), translation_figures.py (figure labels), translation_check.py
(`check`, `stale`) and translation_book.py (`build`); this file is the command line.
"""

from __future__ import annotations

import argparse
import json
import sys

from translation_book import build
from translation_check import check, status
from translation_code import checker_lines_here
from translation_figures import missing_figure_labels
from translation_files import (
    REPO,
    en_hash,
    english_toc,
    listed_stems,
    markdown_stems,
    toc_stems,
    units_for,
)


def todo(name: str) -> None:
    state = status(name)
    print(
        f"# {name}: {len(state['missing'])} missing, {len(state['stale'])} stale, "
        f"{len(state['orphaned'])} orphaned (delete those: {state['orphaned']})"
    )
    for uid, kind, text in units_for(name):
        for what in ("missing", "stale"):
            if uid in state[what]:
                print(f"\n## {uid} ({kind}, {what}) en: {en_hash(text)}\n{text}")
    if (REPO / "chapters" / f"{name}.ipynb").exists():
        labels = missing_figure_labels(name)
        print(f"\n## figure labels without Chinese (figures:): {len(labels)}")
        print("".join(f"  {json.dumps(label, ensure_ascii=False)}: \n" for label in labels), end="")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("todo").add_argument(
        "stem", help="a chapter's file name without .ipynb, or index"
    )
    sub.add_parser("stale")
    sub.add_parser("check")
    sub.add_parser("build")
    sub.add_parser("checker-lines", help="(internal) what every checker prints, as JSON")
    args = parser.parse_args(argv)
    if args.command == "checker-lines":
        print(json.dumps(checker_lines_here(), ensure_ascii=False))
    elif args.command == "todo":
        todo(args.stem)
    elif args.command == "stale":
        names = ["index", *markdown_stems(english_toc()), *toc_stems(english_toc())]
        for name in names:
            state = status(name)
            always = name == "index" or name in markdown_stems(english_toc())
            listed = "" if always or name in listed_stems() else " (not listed)"
            print(f"{name}{listed}: " + ", ".join(f"{len(v)} {k}" for k, v in state.items()))
    elif args.command == "check":
        problems = check()
        print("\n".join(problems) or f"ok: index and {len(listed_stems())} chapters translated")
        return 1 if problems else 0
    else:
        for path in build():
            print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
