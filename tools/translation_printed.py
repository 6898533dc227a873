"""What the chapters print, in Chinese: the printed lines of a Chinese notebook's stored outputs.

The Chinese notebooks keep the English notebooks' code and outputs, so what a cell printed (a
sentence, a table's header, a claim) is English unless it is translated. A translation file may
carry a table `printed:` of the lines its notebook's cells print (to stdout, or as Markdown they
display), and `i18n/zh/printed.yml` one of the lines that `mha` itself prints in every chapter (a
claim's verdict, a progress line):

    printed:
      "GQA == MHA with each key/value head repeated for its group: {}": "GQA 等于把每个键/值头按组重复后的 MHA：{}"
      "{} of {} chapter runs passed": "{1} 次章节运行中有 {0} 次通过"

An English key is a whole printed line (trailing spaces ignored) in which `{}` stands for any
text: numbers, shapes, code names, which the Chinese keeps as they are. The Chinese value puts the
matched texts back in order with `{}`, or in any order with `{0}`, `{1}`, … A paragraph printed as
wrapped lines is one key with its line breaks (`\\n` in the YAML string), replaced as a whole.
`build` replaces every stdout line that a key matches (the notebook's own table first, then the
shared one), and within a line every text a `{}` matched that a key matches whole: the shared
table translates a claim's line, the notebook's table the claim's name in it. `check` refuses a
key that matches no line of the English outputs (nor such a text), a value with other
placeholders than its key, and a value with no Chinese in it.

:func:`english_sentences` is how the tests count what is still English: a printed line with three
English words in a row, whatever else it holds, unless it quotes an error as Python prints it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path

import yaml
from translation_files import I18N

SHARED = "printed"  # i18n/zh/printed.yml: the lines mha prints, in every chapter
CJK = re.compile(r"[\u3400-\u9fff\uff00-\uffef\u3000-\u303f]")
# three English words in a row (a word: a letter and at least one lower-case letter, not a Python
# value such as nan or True), which no shape, number or code name makes on its own
_WORD = r"\b(?!(?:nan|inf|True|False|None)\b)[A-Za-z][a-z]+\b"
SENTENCE = re.compile(rf"{_WORD}(?:[ ,;:'/-]+{_WORD}){{2,}}")
# an error quoted as Python prints it (``expect_error``): its words are Python's or torch's, the
# same in every edition
CODE_SPAN = re.compile(r"`[^`]*`")  # `make gpu-check`: a command, not prose
QUOTED_ERROR = re.compile(r"^\s*(?:\w+\s+)?(?:\w+\.)*\w*(?:Error|Exception):")
FIELD = re.compile(r"\{(\d*)\}")


def load_printed(name: str, i18n: Path | None = None) -> dict[str, str]:
    """The `printed:` table of ``i18n/zh/<name>.yml`` (``name`` = "printed": the shared file)."""
    path = (i18n or I18N) / f"{name}.yml"
    if not path.exists():
        return {}
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.BaseLoader) or {}
    return {str(k).rstrip(): str(v) for k, v in (data.get("printed") or {}).items()}


def tables(stem: str, i18n: Path | None = None) -> list[dict[str, str]]:
    """The tables that put notebook ``stem``'s printed lines in Chinese, in the order they apply:
    its own, then the shared one."""
    return [load_printed(stem, i18n), load_printed(SHARED, i18n)]


@cache
def _pattern(english: str) -> re.Pattern[str]:
    """The regular expression of a key: literal text, `{}` any text (as little as it can)."""
    parts = english.split("{}")
    return re.compile("(.*?)".join(re.escape(p) for p in parts) + r"\Z")


def _fill_match(chinese: str, m: re.Match[str]) -> str:
    return _fill(chinese, m.groups())


def _fill(chinese: str, values: tuple[str, ...]) -> str:
    """The Chinese template with the matched texts: `{}` in order, `{0}` by number."""
    position = iter(range(len(values)))

    def field(m: re.Match[str]) -> str:
        return values[int(m.group(1)) if m.group(1) else next(position)]

    return FIELD.sub(field, chinese)


def translate_line(line: str, tables: Iterable[Mapping[str, str]]) -> str:
    """``line`` in Chinese if a key of one of ``tables`` (tried in order) matches it whole. The
    texts its `{}` matched are translated too, where a key matches one of them whole: a claim's
    name in the notebook's table, inside the shared table's claim line."""
    tables = list(tables)
    body = line.rstrip()
    for table in tables:
        for english, chinese in table.items():
            m = _pattern(english).match(body)
            if m:
                return _fill(chinese, tuple(_field(g, body, tables) for g in m.groups()))
    return line


def _field(text: str, line: str, tables: list[Mapping[str, str]]) -> str:
    """A matched text in Chinese if it has words and a key translates it whole."""
    if text == line or not re.search(r"[A-Za-z]{2}", text):
        return text
    return translate_line(text, tables)


def fields(line: str, tables: Iterable[Mapping[str, str]]) -> list[str]:
    """The texts the `{}` of the first key that matches ``line`` match (with their own)."""
    tables = list(tables)
    body = line.rstrip()
    for table in tables:
        for english in table:
            m = _pattern(english).match(body)
            if m:
                found = [g.rstrip() for g in m.groups() if g != body]
                return found + [f for g in found for f in fields(g, tables)]
    return []


def chinese_printed_output(text: str, tables: Iterable[Mapping[str, str]]) -> str:
    """A stored stdout with every line a table translates in Chinese. A key of several lines
    (a paragraph printed as wrapped lines) replaces those lines together, before single lines."""
    tables = list(tables)
    if not any(tables):
        return text
    for table in tables:
        for english, chinese in table.items():
            if "\n" in english:
                block = re.compile(_pattern(english).pattern.removesuffix(r"\Z"))
                text = block.sub(functools.partial(_fill_match, chinese), text)
    lines = text.split("\n")
    return "\n".join(translate_line(ln, tables) for ln in lines)


def english_sentences(text: str) -> list[str]:
    """The lines of ``text`` that still hold English prose: three English words in a row (a line
    half translated, such as a claim whose name is English, counts)."""
    return [
        ln
        for ln in text.split("\n")
        if SENTENCE.search(CODE_SPAN.sub(" ", ln)) and not QUOTED_ERROR.match(ln)
    ]


def printed_text(output) -> str | None:
    """What a reader reads of a stored output: a stdout stream, or Markdown a cell displays
    (chapter 11's tables); None for anything else (figures, reprs, stderr)."""
    if output.get("output_type") == "stream":
        return "".join(output["text"]) if output.get("name") == "stdout" else None
    markdown = output.get("data", {}).get("text/markdown")
    return None if markdown is None else "".join(markdown)


def translate_output(output, tables: Iterable[Mapping[str, str]]) -> None:
    """Put a stored output's printed lines (stdout, displayed Markdown) in Chinese, in place."""
    text = printed_text(output)
    if text is None:
        return
    text = chinese_printed_output(text, tables)
    if output.get("output_type") == "stream":
        output["text"] = text
    else:
        output["data"]["text/markdown"] = text


def printed_lines(nb) -> list[str]:
    """Every line of the stored outputs of ``nb`` (a notebook) a reader reads, in page order."""
    lines: list[str] = []
    for cell in nb.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            text = printed_text(output)
            lines += [] if text is None else text.split("\n")
    return lines


def printed_problems(name: str, english_nb, i18n: Path | None = None) -> list[str]:
    """What is wrong with the `printed:` table of ``name``: keys that match no printed line of
    the English notebook, values with other placeholders than their key or without Chinese."""
    problems = []
    lines = [ln.rstrip() for ln in printed_lines(english_nb)]
    table, shared = load_printed(name, i18n), load_printed(SHARED, i18n)
    lines += [f for ln in lines for f in fields(ln, [table, shared])]  # e.g. the names of claims
    for english, chinese in table.items():
        where = f"{name}: printed {english!r}"
        if not _matches(english, lines):
            problems.append(f"{where}: no printed line matches it (the output changed?)")
        problems += _value_problems(where, english, chinese)
    return problems


def shared_problems(notebooks: Iterable, i18n: Path | None = None) -> list[str]:
    """The shared table's problems: each key must match a printed line of some notebook."""
    lines = [ln.rstrip() for nb in notebooks for ln in printed_lines(nb)]
    problems = []
    for english, chinese in load_printed(SHARED, i18n).items():
        where = f"{SHARED}.yml: {english!r}"
        if not _matches(english, lines):
            problems.append(f"{where}: no printed line of any chapter matches it")
        problems += _value_problems(where, english, chinese)
    return problems


def _matches(english: str, lines: list[str]) -> bool:
    """Does a key match a printed line (or, a key of several lines, consecutive lines)?"""
    if "\n" not in english:
        return any(_pattern(english).match(ln) for ln in lines)
    block = re.compile(_pattern(english).pattern.removesuffix(r"\Z"))
    return block.search("\n".join(lines)) is not None


def _value_problems(where: str, english: str, chinese: str) -> list[str]:
    count = english.count("{}")
    fields = FIELD.findall(chinese)
    numbered = sorted(int(f) for f in fields if f)
    problems = []
    if not CJK.search(chinese):
        problems.append(f"{where}: the value has no Chinese")
    if numbered and len(numbered) != len(fields):
        problems.append(f"{where}: the value mixes {{}} and {{0}}-style fields")
    elif numbered and numbered != list(range(count)):
        problems.append(f"{where}: the value must use {{0}} … {{{count - 1}}} once each")
    elif not numbered and len(fields) != count:
        problems.append(f"{where}: the key has {count} {{}}, the value {len(fields)}")
    return problems
