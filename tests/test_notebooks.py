"""Guards on the committed chapter notebooks.

The notebook test (tests/test_colab_run.py, `make test-notebooks`) executes every chapter once and
compares its outputs with the stored ones; these tests execute nothing and check what that run
cannot: that the stored notebooks were executed top to bottom in a fresh kernel, carry the shared
setup cell, show no unexpected errors, warnings or machine paths, and that every exercise has an
executed, auto-checked solution. They also keep _toc.yml and chapters/ in step.

A chapter is one notebook (`NN_name.ipynb`), or an opening page of that name followed by its
sections (`NN_K_name.ipynb`, K = 1, 2, ..., listed under the chapter's `sections:` in _toc.yml):
each section runs alone, opens with its own label and title, and is linked from the opening page,
which has no exercises. A chapter's exercises are counted over its opening page and sections.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from pathlib import Path
from urllib.parse import urlparse

import nbformat
import pytest
from conftest import REPO, toc_chapter_files, toc_chapters

sys.path.insert(0, str(REPO / "tools"))
from fold_solutions import solution_ranges  # noqa: E402 (tools/ joins the path first)

SETUP_CELL = REPO / "tools" / "setup_cell.txt"
NOTEBOOKS = sorted((REPO / "chapters").glob("[0-9][0-9]_*.ipynb"))
# A section of chapter NN: chapters/NN_K_name.ipynb (K = 1, 2, ...).
SECTION_RE = re.compile(r"^(\d\d)_(\d+)_\w+$")
LABEL_LINE_RE = re.compile(r"^\(([^()\s]+)\)=$")

# Directive openings as MyST writes them: ```{name} ... , ````{name} ... or :::{name} ...
FENCE = r"^[ \t]*(?:`{3,}|:{3,})"
EXERCISE_RE = re.compile(FENCE + r"\{exercise(?:-start)?\}", re.MULTILINE)
SOLUTION_START_RE = re.compile(FENCE + r"\{solution-start\}[ \t]+(\S+)", re.MULTILINE)
SOLUTION_END_RE = re.compile(FENCE + r"\{solution-end\}", re.MULTILINE)
CHECKER_CALL_RE = re.compile(r"\bmha\.exercises\.check_\w+\s*\(")
PIP_URL_RE = re.compile(r"%pip install[^\n]*git\+(\S+?)[\"'\s]")


def tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def executed(cell) -> bool:
    return cell.cell_type == "code" and "skip-execution" not in tags(cell)


def normalise_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url.removesuffix(".git")


def output_texts(output) -> list[str]:
    """Every piece of text an output shows (images excluded)."""
    if output.output_type == "stream":
        return [output.text]
    if output.output_type == "error":
        return [output.ename, output.evalue, *output.traceback]
    texts = []
    for mime, value in output.get("data", {}).items():
        if not mime.startswith("image/"):
            texts.append(value if isinstance(value, str) else str(value))
    return texts


def exercise_labels(source: str) -> list[str | None]:
    """Labels of the {exercise} directives in a markdown cell (None for an unlabelled one)."""
    labels = []
    for match in EXERCISE_RE.finditer(source):
        # Options follow the directive line directly; the first blank line ends them.
        options = source[match.end() :].split("\n\n", 1)[0]
        label = re.search(r"^[ \t]*:label:[ \t]*(\S+)", options, re.MULTILINE)
        labels.append(label.group(1) if label else None)
    return labels


@pytest.fixture(scope="module", params=NOTEBOOKS, ids=lambda p: p.name)
def notebook(request) -> tuple[Path, nbformat.NotebookNode]:
    path = request.param
    return path, nbformat.read(path, as_version=4)


# --- the book and the chapters agree ---------------------------------------------------------


def test_every_toc_chapter_exists_and_every_chapter_is_in_the_toc(toc):
    listed = toc_chapter_files(toc)
    assert listed, "_toc.yml lists no chapters"
    assert len(listed) == len(set(listed)), f"_toc.yml lists a file twice: {listed}"
    missing = [
        f for f in listed if not (REPO / f"{f}.ipynb").exists() and not (REPO / f"{f}.md").exists()
    ]
    assert not missing, f"in _toc.yml but not in the repository: {missing}"
    on_disk = {f"chapters/{p.stem}" for p in NOTEBOOKS}
    unlisted = sorted(on_disk - set(listed))
    assert not unlisted, f"chapter notebooks missing from _toc.yml: {unlisted}"
    assert (REPO / f"{toc['root']}.md").exists(), f"the landing page {toc['root']}.md is missing"


def test_setup_cell_installs_from_the_repository_in_config(book_config):
    text = SETUP_CELL.read_text(encoding="utf-8")
    urls = PIP_URL_RE.findall(text)
    assert len(urls) == 1, (
        f"expected one `%pip install ... git+URL` line in {SETUP_CELL.name}, found {urls}"
    )
    repository = book_config["repository"]["url"]
    assert normalise_url(urls[0]) == normalise_url(repository), (
        f"the setup cell installs from {urls[0]} but _config.yml's repository.url is {repository}"
    )


def test_readme_and_ci_agree_with_config(book_config):
    """The README's Colab links, its Pages URL and the deploy branch all follow _config.yml."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    owner_repo = urlparse(normalise_url(book_config["repository"]["url"])).path.strip("/")
    branch = book_config["repository"]["branch"]
    links = re.findall(r"https://colab\.research\.google\.com/github/([^)\s\"'>]+)", readme)
    assert links, "the README has no Colab link"
    prefix = f"{owner_repo}/blob/{branch}/"
    for link in links:
        assert link.startswith(prefix), (
            f"README Colab link {link} is not under {prefix} (from _config.yml)"
        )
        assert (REPO / link.removeprefix(prefix)).exists(), (
            f"README Colab link to a missing file: {link}"
        )
    unlinked = [p.name for p in NOTEBOOKS if f"{prefix}chapters/{p.name}" not in links]
    assert not unlinked, f"chapters missing from the README's chapter list: {unlinked}"
    baseurl = book_config["html"]["baseurl"]
    assert baseurl in readme, f"the README does not give the book's address {baseurl}"
    workflows = "".join(
        p.read_text(encoding="utf-8") for p in (REPO / ".github" / "workflows").glob("*.yml")
    )
    assert f"refs/heads/{branch}" in workflows, (
        f"no workflow deploys from the branch {branch!r} of _config.yml"
    )


def opening_label(nb) -> str | None:
    """The label on the first line of a notebook's first cell: `(label)=`."""
    lines = [line.strip() for line in nb.cells[0].source.splitlines() if line.strip()]
    match = LABEL_LINE_RE.match(lines[0]) if lines else None
    return match.group(1) if match else None


def test_sections_are_named_after_their_chapter_and_linked_from_its_opening_page(toc):
    chapters = toc_chapters(toc)
    listed_sections = {s for sections in chapters.values() for s in sections}
    for chapter, sections in chapters.items():
        stem = Path(chapter).name
        assert not SECTION_RE.match(stem), (
            f"_toc.yml lists {chapter} as a chapter; a NN_K_name notebook is a section: list it "
            f"under its chapter's `sections:`"
        )
        if not sections:
            continue
        opening = nbformat.read(REPO / f"{chapter}.ipynb", as_version=4)
        markdown = "\n".join(c.source for c in opening.cells if c.cell_type == "markdown")
        for k, section in enumerate(sections, start=1):
            name = Path(section).name
            assert name.startswith(f"{stem[:2]}_{k}_") and SECTION_RE.match(name), (
                f"section {k} of {chapter} is {section}; name it chapters/{stem[:2]}_{k}_<name>"
            )
            label = opening_label(nbformat.read(REPO / f"{section}.ipynb", as_version=4))
            target = re.escape(str(label))
            linked = re.search(rf"\{{(?:ref|numref)\}}`(?:[^`]*<)?{target}>?`", markdown)
            assert linked, (
                f"{chapter}: the opening page does not link its section {name} ({{ref}}`{label}`)"
            )
    for path in NOTEBOOKS:
        if SECTION_RE.match(path.stem):
            assert f"chapters/{path.stem}" in listed_sections, (
                f"{path.name} is named as a section but _toc.yml does not list it under its "
                f"chapter's `sections:`"
            )


# --- each chapter ----------------------------------------------------------------------------


def test_is_valid_nbformat(notebook):
    path, nb = notebook
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", (
        f"{path.name}: kernel is not python3"
    )


def test_second_cell_is_the_shared_setup_cell(notebook):
    path, nb = notebook
    first = nb.cells[1]  # right after the title: the first code a reader (or Colab) runs
    assert first.cell_type == "code", f"{path.name}: the second cell must be the setup code cell"
    expected = SETUP_CELL.read_text(encoding="utf-8").rstrip("\n")
    assert first.source.rstrip("\n") == expected, (
        f"{path.name}: the setup cell differs from tools/setup_cell.txt; paste that file's text exactly"
    )
    for tag in ("hide-input", "nbval-ignore-output"):
        assert tag in tags(first), (
            f"{path.name}: the setup cell must be tagged {tag!r}, has {tags(first)}"
        )


def test_chapter_opens_with_label_and_title(notebook, toc):
    path, nb = notebook
    cell = nb.cells[0]
    assert cell.cell_type == "markdown", f"{path.name}: the first cell must be markdown"
    lines = [line for line in cell.source.splitlines() if line.strip()]
    label = f"(ch{path.name[:2]})="
    if SECTION_RE.match(path.stem):  # a section: a label of its own under the chapter's
        label = f"(ch{path.name[:2]}-<name>)="
        assert lines and re.fullmatch(rf"\(ch{path.name[:2]}-[\w-]+\)=", lines[0].strip()), (
            f"{path.name}: a section's first cell must start with a label line {label}, "
            f"got {lines[:1]}"
        )
    else:
        assert lines and lines[0].strip() == label, (
            f"{path.name}: the first cell must start with the label line {label}, got {lines[:1]}"
        )
    assert len(lines) > 1 and re.match(r"# \S", lines[1]), (
        f"{path.name}: the label must be followed by the chapter title as a '# ' heading, got {lines[1:2]}"
    )
    numbered = any(part.get("numbered") for part in toc.get("parts", []))
    if numbered:
        assert not re.match(r"#\s*\d+[.)]?\s", lines[1]), (
            f"{path.name}: _toc.yml numbers the chapters, so the title must not carry its own number "
            f"(it would read '1. 1. ...'): {lines[1]!r}"
        )


def test_executed_top_to_bottom_in_a_fresh_kernel(notebook):
    path, nb = notebook
    code = [c for c in nb.cells if c.cell_type == "code"]
    empty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and not c.source.strip()]
    assert not empty, f"{path.name}: empty code cells at indices {empty} (they are never executed)"
    counts = [c.execution_count for c in code if executed(c)]
    assert counts == list(range(1, len(counts) + 1)), (
        f"{path.name}: execution counts {counts} are not 1..{len(counts)}; "
        f"re-run it with `make execute` (tools/execute_notebook.py)"
    )
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and not executed(cell):
            assert cell.execution_count is None and not cell.outputs, (
                f"{path.name}, cell {i}: a skip-execution cell must be stored unexecuted, without outputs"
            )
            # nbval does not know the skip-execution tag (myst-nb and nbclient do); nbval-skip also
            # keeps the notebook test from comparing the stub's outputs (it runs it, as Colab).
            assert "nbval-skip" in tags(cell), (
                f"{path.name}, cell {i}: a skip-execution cell must also be tagged nbval-skip, "
                f"or nbval runs it; tags are {tags(cell)}"
            )


def test_no_errors_and_no_stderr(notebook):
    """Colab's and Jupyter's "Run all" honour no tags and stop at the first error, so no cell may
    raise, not even on purpose: a deliberate error is shown with `with mha.expect_error(...)`."""
    path, nb = notebook
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        assert "raises-exception" not in tags(cell), (
            f"{path.name}, cell {i}: tagged raises-exception; Colab ignores tags and stops there. "
            f"Show the error with `with mha.expect_error(TheError): ...` instead"
        )
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert not errors, (
            f"{path.name}, cell {i}: {errors[0].ename}: {errors[0].evalue} "
            f"(show a deliberate error with `with mha.expect_error({errors[0].ename}): ...`)"
        )
        stderr = [o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stderr"]
        assert not stderr, (
            f"{path.name}, cell {i}: writes to stderr (silence it at the source): {stderr[0][:300]!r}"
        )
        svg = [o for o in cell.outputs if "image/svg+xml" in o.get("data", {})]
        assert not svg, (
            f"{path.name}, cell {i}: SVG output (nbval compares SVG text); show figures as PNG"
        )


def test_outputs_show_no_paths_of_this_machine(notebook):
    path, nb = notebook
    forbidden = {str(REPO), str(REPO.resolve()), sys.prefix, str(Path.home()) + "/"}
    patterns = [
        re.compile(r"[/\\](?:site|dist)-packages[/\\]"),
        re.compile(r"[/\\]\.venv[/\\]"),
        # Typical roots of checkouts and temporary files, on this machine or any other.
        re.compile(
            r"(?<![\w.~])/(?:home|root|Users|tmp|work|workspace|mnt|opt|srv|private|content)/\w"
        ),
        re.compile(r"\b[A-Za-z]:\\(?:Users|Windows)\\"),
    ]
    for i, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            for text in output_texts(output):
                hits = [s for s in forbidden if s in text] + [
                    p.pattern for p in patterns if p.search(text)
                ]
                assert not hits, (
                    f"{path.name}, cell {i}: an output shows a path of the machine that ran it ({hits}); "
                    f"print relative paths, and show deliberate errors with `mha.expect_error`. "
                    f"Output: {text[:300]!r}"
                )


def appendix_files(toc: dict) -> set[str]:
    """Files of the _toc.yml part captioned "Appendix": reference pages, which have no exercises."""
    parts = [p for p in toc.get("parts", []) if p.get("caption") == "Appendix"]
    return set(toc_chapter_files({"parts": parts}))


def skip_appendix(path: Path, toc: dict) -> None:
    if f"chapters/{path.stem}" in appendix_files(toc):
        pytest.skip(f"{path.name} is in the Appendix part of _toc.yml: no exercises")


def notebook_exercises(nb) -> list[tuple[int, str | None]]:
    """(cell index, label) of every {exercise} block of a notebook."""
    return [
        (i, label)
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "markdown"
        for label in exercise_labels(cell.source)
    ]


def test_every_chapter_has_at_least_three_exercises(toc):
    """Counted over a chapter's notebook and its sections; an opening page itself has none."""
    appendix = appendix_files(toc)
    for chapter, sections in toc_chapters(toc).items():
        if chapter in appendix or not chapter.startswith("chapters/"):
            continue
        counts = {
            f: len(notebook_exercises(nbformat.read(REPO / f"{f}.ipynb", as_version=4)))
            for f in [chapter, *sections]
        }
        assert sum(counts.values()) >= 3, (
            f"{chapter}: {sum(counts.values())} {{exercise}} blocks over {list(counts)}, "
            f"at least 3 required"
        )
        if sections:
            assert counts[chapter] == 0, (
                f"{chapter} opens a chapter of sections: its exercises belong in the sections"
            )


def test_exercises_have_executed_auto_checked_solutions(notebook, toc):
    path, nb = notebook
    skip_appendix(path, toc)
    exercises = notebook_exercises(nb)
    unlabelled = [i for i, label in exercises if label is None]
    assert not unlabelled, f"{path.name}: {{exercise}} without :label: in cells {unlabelled}"

    for ex_index, label in exercises:
        starts = [
            i
            for i, c in enumerate(nb.cells)
            if c.cell_type == "markdown" and label in SOLUTION_START_RE.findall(c.source)
        ]
        assert len(starts) == 1, (
            f"{path.name}: exercise {label} needs exactly one {{solution-start}} {label}, found {len(starts)}"
        )
        start = starts[0]
        assert start > ex_index, f"{path.name}: the solution of {label} comes before its exercise"
        ends = [
            i
            for i in range(start + 1, len(nb.cells))
            if nb.cells[i].cell_type == "markdown" and SOLUTION_END_RE.search(nb.cells[i].source)
        ]
        assert ends, f"{path.name}: {{solution-start}} {label} has no {{solution-end}} after it"
        body = nb.cells[start + 1 : ends[0]]
        code = [c for c in body if c.cell_type == "code"]
        assert code, f"{path.name}: the solution of {label} contains no code cell"
        skipped = [c for c in code if not executed(c)]
        assert not skipped, (
            f"{path.name}: the solution of {label} has a skip-execution cell; solutions are executed"
        )
        checked = [c for c in code if CHECKER_CALL_RE.search(c.source)]
        assert checked, (
            f"{path.name}: the solution of {label} never calls mha.exercises.check_...(...)"
        )
        for cell in checked:
            assert cell.execution_count is not None, (
                f"{path.name}: the solution of {label} is not executed"
            )
            assert not [o for o in cell.outputs if o.output_type == "error"], (
                f"{path.name}: the checker rejected the solution of {label}"
            )
            printed = "".join(
                o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout"
            )
            assert printed.strip(), f"{path.name}: the solution of {label} shows no checker message"


# --- read where readers run it: Colab and Jupyter ---------------------------------------------

TITLE_RE = re.compile(r"^#\s*@title\s+\S")
BACKTICK_EXERCISE_RE = re.compile(r"^[ \t]*`{3,}\{(?:exercise|solution)[\w-]*\}", re.MULTILINE)
FOLD_HINT = "run `python tools/fold_solutions.py` on it (`make execute` does)"


def source_hidden(cell) -> bool:
    return cell.get("metadata", {}).get("jupyter", {}).get("source_hidden") is True


def test_solutions_are_folded_in_colab_and_jupyterlab(notebook, toc):
    """The book folds a solution into a dropdown; Colab and JupyterLab must fold it too."""
    path, nb = notebook
    skip_appendix(path, toc)
    ranges = solution_ranges(nb)
    assert ranges or not notebook_exercises(nb), f"{path.name}: no solutions found"
    inside = set()
    for start, end in ranges:
        for marker in (start, end):
            # The markers stay visible; anything else in their cell would not be folded.
            rest = re.sub(
                r"^:{3,}\{solution-(?:start|end)\}.*?^:{3,}[ \t]*$",
                "",
                nb.cells[marker].source,
                flags=re.MULTILINE | re.DOTALL,
            ).strip()
            assert not rest, (
                f"{path.name}, cell {marker}: text next to a solution marker is never folded; "
                f"give the marker a cell of its own (a :::-fenced directive alone). Text: {rest[:200]!r}"
            )
        body = range(start + 1, end)
        inside.update(body)
        for i in body:
            cell = nb.cells[i]
            assert source_hidden(cell), (
                f"{path.name}, cell {i} (a solution): needs metadata jupyter.source_hidden: true "
                f"to be folded in JupyterLab; {FOLD_HINT}"
            )
            if cell.cell_type == "code":
                assert cell.metadata.get("cellView") == "form", (
                    f"{path.name}, cell {i} (a solution): needs metadata cellView: form to be "
                    f"folded in Colab; {FOLD_HINT}"
                )
                assert TITLE_RE.match(cell.source), (
                    f"{path.name}, cell {i} (a solution): must start with a `# @title Solution` "
                    f"line, the title Colab shows for the folded cell; {FOLD_HINT}"
                )
    for i, cell in enumerate(nb.cells):
        if i not in inside:
            folded = source_hidden(cell) or cell.get("metadata", {}).get("cellView") == "form"
            # A proof cell (a check beside the lesson) is folded everywhere: `hide-input` in the
            # book, a form titled by its `# @title` line in Colab, source_hidden in JupyterLab.
            proof = (
                cell.cell_type == "code"
                and "hide-input" in cell.get("metadata", {}).get("tags", [])
                and cell.metadata.get("cellView") == "form"
                and source_hidden(cell)
                and TITLE_RE.match(cell.source)
            )
            assert not folded or proof, (
                f"{path.name}, cell {i}: folded in Colab/JupyterLab but neither part of a "
                f"solution nor a proof cell (tag hide-input, cellView form, source_hidden and a "
                f"`# @title` first line)"
            )


def test_exercises_read_as_text_in_a_notebook(notebook):
    """Colab and Jupyter show a MyST directive as raw text. Fenced with backticks, an exercise
    becomes a code block there: no title, no math, long lines cut off. Fenced with colons it stays
    markdown, readable with its math."""
    path, nb = notebook
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            match = BACKTICK_EXERCISE_RE.search(cell.source)
            assert not match, (
                f"{path.name}, cell {i}: {match.group(0).strip()!r} is fenced with backticks; "
                f"use a colon fence (:::{{exercise}} ... :::) so that notebooks show it as text"
            )


def test_figures_have_alt_text_and_a_caption_and_are_sharp(notebook):
    """Every figure says what it shows (MyST-NB cell metadata mystnb.image.alt, read by screen
    readers and shown when the image cannot load), has a caption (mystnb.figure.caption), and is
    stored at twice its display size (the setup cell's retina format) so it is sharp on
    high-density screens."""
    path, nb = notebook
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        pngs = [o for o in cell.outputs if "image/png" in o.get("data", {})]
        if not pngs:
            continue
        options = cell.metadata.get("mystnb", {})
        alt = options.get("image", {}).get("alt", "")
        caption = options.get("figure", {}).get("caption", "")
        if len(alt.split()) < 6 or ".png" in alt:
            problems.append(f"cell {i}: alt text {alt!r} does not say what the figure shows")
        if len(caption.split()) < 2:
            problems.append(f"cell {i}: no figure caption (mystnb.figure.caption)")
        for o in pngs:
            size = o.get("metadata", {}).get("image/png", {})
            if "width" not in size:
                problems.append(f"cell {i}: a PNG without display width (not retina output)")
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


# A code cell's line that fits the book's text column at desktop width (tests/test_browser.py
# checks the rendered page, folded cells opened: a wider cell scrolls sideways). Width is counted
# in monospace columns: a wide character (Chinese, full-width punctuation) takes two.
CODE_COLUMNS = 82
ZH_NOTEBOOKS = sorted((REPO / "zh" / "chapters").glob("[0-9][0-9]_*.ipynb"))


def display_columns(line: str) -> int:
    """A line's width in monospace columns: two for an East Asian wide or full-width character."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)


def too_wide_code_lines(nb) -> list[str]:
    return [
        f"cell {i}: {display_columns(line)} columns: {line.strip()[:60]}"
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and i != 1  # cell 1: the setup cell
        for line in cell.source.splitlines()
        if display_columns(line) > CODE_COLUMNS
    ]


def test_code_fits_the_column(notebook):
    path, nb = notebook
    long = too_wide_code_lines(nb)
    assert not long, f"{path.name}: code lines wider than {CODE_COLUMNS} columns:\n" + "\n".join(
        long
    )


@pytest.mark.parametrize("path", ZH_NOTEBOOKS, ids=lambda p: f"zh-{p.name}")
def test_chinese_code_fits_the_column(path):
    """The Chinese notebooks' code (comments translated under `code:` in i18n/zh/<stem>.yml)."""
    long = too_wide_code_lines(nbformat.read(path, as_version=4))
    assert not long, (
        f"zh/chapters/{path.name}: code lines wider than {CODE_COLUMNS} columns (a Chinese "
        "character counts two; shorten the comment in i18n/zh/):\n" + "\n".join(long)
    )


def test_a_chinese_character_takes_two_columns():
    assert display_columns("x = 1  # 一") == 11
    assert display_columns("（查询，键）") == 12
    assert display_columns("abc") == 3


# A line that asserts, or a measured claim (mha.lab.claims.claim asserts and records it).
CHECK_LINE_RE = re.compile(r"^\s*assert\b|\bclaim\(", re.MULTILINE)
MAX_VISIBLE_CHECKS = 2
FOLDED_TAGS = {"hide-input", "hide-cell", "remove-input", "remove-cell"}


def test_teaching_cells_leave_their_checks_to_a_folded_cell(notebook):
    """Visible cells teach (they print and plot); the asserts and measured claims that prove
    what they show sit in a folded checks cell beside them (`# @title Checks: …`, shown with its
    output). A visible cell may still carry a check or two where the check is the lesson."""
    path, nb = notebook
    crowded = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not executed(cell) or source_hidden(cell):
            continue
        if FOLDED_TAGS & set(tags(cell)):
            continue
        checks = len(CHECK_LINE_RE.findall(cell.source))
        if checks > MAX_VISIBLE_CHECKS:
            crowded.append(f"cell {i} ({cell.get('id')}): {checks} asserts/claims")
    assert not crowded, (
        f"{path.name}: visible teaching cells with more than {MAX_VISIBLE_CHECKS} asserts or "
        "claims; move them into a folded checks cell after it (tag hide-input, cellView form, "
        "source_hidden, first line `# @title Checks: ...`):\n" + "\n".join(crowded)
    )


# The reading times a page states: a section's "**Time:** about N minutes to read" and each
# station "~N min to read" of its chapter's storyline (the opening page), in both editions, against
# the reviewers' measure of the learner's path (../shared/tools/reading_time.py: prose words / 200,
# visible code lines / 10, half a minute per figure, printed lines / 60).
READING_TIME = REPO.parent / "shared" / "tools" / "reading_time.py"
SECTION_TIME_RE = re.compile(r"\*\*Time:\*\* about (\d+) minutes to read")
SECTION_TIME_ZH_RE = re.compile(r"\*\*时间\*\*：阅读约(\d+)分钟")
STATION_RE = re.compile(r"\{ref\}`([\w-]+)`\n\n[^\n]*\n\n\s*~(\d+) min to read")
STATION_ZH_RE = re.compile(r"\{ref\}`([\w-]+)`\n\n[^\n]*\n\n\s*阅读约(\d+)分钟")


def stated_minutes(path: Path, time_re: re.Pattern, station_re: re.Pattern) -> dict[str, int]:
    """{section label or "self": minutes} as the notebook at ``path`` states them."""
    nb = nbformat.read(path, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    stated = {label: int(n) for label, n in station_re.findall(text)}
    own = time_re.search(text)
    if own:
        stated["self"] = int(own.group(1))
    return stated


def test_stated_reading_times_match_the_learners_path(toc):
    if not READING_TIME.exists():
        pytest.skip(f"{READING_TIME} is not beside the repository")
    import importlib.util

    spec = importlib.util.spec_from_file_location("reading_time", READING_TIME)
    reading_time = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reading_time)
    measured, label_of = {}, {}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        measured[path.stem] = reading_time.minutes(nb)[-1]
        label_of[path.stem] = opening_label(nb)
    stem_of = {label: stem for stem, label in label_of.items()}
    problems, stations = [], 0
    for path in NOTEBOOKS:
        for edition, time_re, station_re, source in (
            ("en", SECTION_TIME_RE, STATION_RE, path),
            ("zh", SECTION_TIME_ZH_RE, STATION_ZH_RE, REPO / "zh" / "chapters" / path.name),
        ):
            if not source.exists():
                continue
            for label, n in stated_minutes(source, time_re, station_re).items():
                stem = path.stem if label == "self" else stem_of.get(label)
                if stem is None:
                    problems.append(f"{edition} {path.name}: a storyline names {label}, no section")
                    continue
                stations += label != "self"
                m = measured[stem]
                if abs(n - m) > max(2.0, 0.15 * m):
                    problems.append(
                        f"{edition} {path.name}: says ~{n} min for {stem}, measured {m:.1f}"
                    )
    assert stations >= 30, f"only {stations} storyline stations found: has their format changed?"
    assert not problems, "stated reading times off (update them):\n" + "\n".join(problems)
