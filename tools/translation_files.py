"""The English text to translate and the translation files that translate it (i18n/zh/).

Where everything lives (the checkout, i18n/zh/, zh/), the translation units of every page (a
notebook's markdown cells and figure captions, a markdown page's `##` blocks, each keyed by cell id
or heading), the pages of the English table of contents, and the readers of the files in i18n/zh/:
a page's `cells:` (each entry with `en:`, the hash of the English it translates), `figures:` and
`code:`, the list of translated chapters, and the glossary. Every other module of the Chinese
edition reads i18n/zh/ through these functions.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import nbformat
import yaml

REPO = Path(__file__).resolve().parents[1]
I18N = REPO / "i18n" / "zh"
ZH = REPO / "zh"
LISTED = I18N / "chapters.txt"
GLOSSARY = I18N / "glossary.yml"
# Pages of the book generated from i18n/zh/glossary.yml (not translated cell by cell).
GLOSSARY_STEM = "glossary"


def en_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


# --- what is translated ------------------------------------------------------------------------


def figure_text(cell) -> tuple[str, str] | None:
    m = cell.metadata.get("mystnb")
    if cell.cell_type != "code" or not m or "image" not in m or "figure" not in m:
        return None
    return m["image"]["alt"], m["figure"]["caption"]


def notebook_units(nb) -> list[tuple[str, str, str]]:
    """(id, kind, English text) for every translatable cell, in notebook order."""
    units = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            units.append((cell.id, "markdown", cell.source))
        elif (fig := figure_text(cell)) is not None:
            units.append((cell.id, "figure", fig[0] + "\n" + fig[1]))
    return units


def heading_slug(line: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", line.lstrip("#").strip().lower()).strip("-")


def index_blocks(text: str) -> list[tuple[str, str]]:
    """The landing page cut before every `## ` heading: (key, text); the first block is "title"."""
    blocks: list[tuple[str, list[str]]] = [("title", [])]
    fence = None
    for line in text.splitlines(keepends=True):
        m = re.match(r"\s*(`{3,}|:{3,})", line)
        if m:
            fence = None if fence and m.group(1).startswith(fence) else (fence or m.group(1))
        if fence is None and line.startswith("## "):
            # A heading with no Latin letters or digits (a post's Chinese title) is keyed by its
            # place on the page; keys stay unique.
            key = heading_slug(line) or f"section-{len(blocks)}"
            while key in {k for k, _ in blocks}:
                key += "-again"
            blocks.append((key, []))
        blocks[-1][1].append(line)
    return [(key, "".join(lines)) for key, lines in blocks]


def index_units(name: str = "index") -> list[tuple[str, str, str]]:
    """The translation units of a markdown page (the landing page by default): its `##` blocks."""
    text = (REPO / "chapters" / f"{name}.md").read_text(encoding="utf-8")
    return [(key, "markdown", block) for key, block in index_blocks(text)]


def listed_stems() -> list[str]:
    lines = LISTED.read_text(encoding="utf-8").splitlines()
    return [ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip()]


def english_toc() -> dict:
    return yaml.safe_load((REPO / "_toc.yml").read_text(encoding="utf-8"))


def toc_files(entries: list[dict]) -> list[str]:
    """The files of toc entries and of their `sections:`, in reading order."""
    files = []
    for entry in entries or []:
        files += [entry["file"]] if "file" in entry else []
        files += toc_files(entry.get("sections", []))
    return files


def all_toc_stems(toc: dict) -> list[str]:
    """Every page of the table of contents under chapters/, notebooks and markdown pages."""
    files = [f for part in toc.get("parts", []) for f in toc_files(part.get("chapters", []))]
    return [f.removeprefix("chapters/") for f in files if f.startswith("chapters/")]


def toc_stems(toc: dict) -> list[str]:
    """The notebooks of the table of contents: chapters and their sections."""
    return [s for s in all_toc_stems(toc) if (REPO / "chapters" / f"{s}.ipynb").exists()]


def markdown_stems(toc: dict) -> list[str]:
    """The markdown pages of the table of contents translated by `##` blocks (not the glossary)."""
    return [
        s
        for s in all_toc_stems(toc)
        if s != GLOSSARY_STEM and not (REPO / "chapters" / f"{s}.ipynb").exists()
    ]


def chapter_groups(toc: dict) -> list[list[str]]:
    """Each chapter's pages (its opening page, then its sections), in reading order."""
    groups = []
    for part in toc.get("parts", []):
        for chapter in part.get("chapters", []):
            files = toc_files([chapter])
            groups.append([f.removeprefix("chapters/") for f in files if f.startswith("chapters/")])
    return [g for g in groups if g]


def units_for(name: str) -> list[tuple[str, str, str]]:
    if name == "index" or (REPO / "chapters" / f"{name}.md").exists():
        return index_units(name)
    return notebook_units(nbformat.read(REPO / "chapters" / f"{name}.ipynb", as_version=4))


def load_translation(name: str, i18n: Path | None = None) -> dict:
    path = (i18n or I18N) / f"{name}.yml"
    if not path.exists():
        return {}
    # BaseLoader reads every scalar as a string: a hash or cell id of digits stays text.
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.BaseLoader) or {}
    return data.get("cells") or {}


def load_figure_labels(name: str, i18n: Path | None = None) -> dict[str, str] | None:
    """The Chinese of the texts ``name``'s figures draw (``figures:``, English text: Chinese;
    ``{}`` in both stands for a number; read tools/figure_text.py), or None without a file."""
    path = (i18n or I18N) / f"{name}.yml"
    if not path.exists():
        return None
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.BaseLoader) or {}
    return dict(data.get("figures") or {})


# `code:` of a notebook's file: per code cell id, `comments:` (the English comment text after "# ":
# its Chinese); tools/translation_code.py applies and checks them.


def load_code_comments(name: str, i18n: Path | None = None) -> dict[str, dict[str, str]]:
    path = (i18n or I18N) / f"{name}.yml"
    if not path.exists():
        return {}
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.BaseLoader) or {}
    return {uid: entry.get("comments") or {} for uid, entry in (data.get("code") or {}).items()}


def load_glossary(path: Path | None = None) -> list[dict]:
    return yaml.safe_load((path or GLOSSARY).read_text(encoding="utf-8"))["terms"]


def translated(units, cells: dict) -> dict[str, dict]:
    """The up-to-date entries only: a missing or stale cell keeps its English text."""
    return {
        uid: cells[uid] for uid, _, text in units if cells.get(uid, {}).get("en") == en_hash(text)
    }
