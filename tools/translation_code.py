"""The code cells a Chinese reader runs: translated comments, the setup cell, the checkers' lines.

A translation file may translate the comments of code cells, under `code:` (beside `cells:`):

    code:
      73adc9b5:               # a code cell's id
        comments:             # the text after "# " in the English cell -> the Chinese text
          model width: 模型维度

Only comments change: `check` tokenizes both versions and requires every other token to be the
same. A comment that the English cell no longer has is reported (and the cell keeps its English).

The setup cell of a Chinese notebook has Chinese comments, finds the checkout two folders up and
switches the exercise checkers to Chinese; every checker's success line in a stored output is
replaced by what that checker prints in Chinese.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

from translation_files import REPO, load_code_comments

# --- code comments --------------------------------------------------------------------------------


def with_comments(source: str, comments: dict[str, str]) -> str:
    for english, chinese in comments.items():
        source = source.replace(f"# {english}", f"# {chinese}")
    return source


def code_tokens(source: str) -> list[tuple[int, str]]:
    """The tokens of a code cell without its comments (IPython magics tokenize as operators)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    try:
        return [(t.type, t.string) for t in tokens if t.type != tokenize.COMMENT]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [(-1, re.sub(r"#.*", "", source))]


def comment_problems(name: str, nb, i18n: Path | None = None) -> list[str]:
    code = {cell.id: cell for cell in nb.cells if cell.cell_type == "code"}
    problems = []
    for uid, comments in load_code_comments(name, i18n).items():
        cell = code.get(uid)
        if cell is None:
            problems.append(f"{name}: code {uid}: no such code cell")
            continue
        problems += [
            f"{name}: code {uid}: the cell has no comment '# {english}' (stale)"
            for english in comments
            if f"# {english}" not in cell.source
        ]
        if code_tokens(with_comments(cell.source, comments)) != code_tokens(cell.source):
            problems.append(f"{name}: code {uid}: the translation changes code, not only comments")
    return problems


# --- the setup cell and the checkers' output ------------------------------------------------------

SETUP_CELL = REPO / "tools" / "setup_cell.txt"
# Every comment line of tools/setup_cell.txt, in Chinese (a new English comment fails the build
# until it is added here); code lines are kept, except the two rewritten below.
SETUP_COMMENTS = {
    "# Setup. On Colab: install the course package `mha` from the repository": (
        "# 准备工作。在Colab上：从代码仓库安装课程的Python包`mha`"
    ),
    "# (Colab's own torch and numpy stay untouched). Locally: use the checkout": (
        "# （Colab自带的torch和numpy保持不变）。在本地：使用本notebook所在的"
    ),
    "# this notebook lives in.": "# 检出目录（zh/chapters/的上两级）。",
    "# Figures at twice their size: sharp on high-density screens. Their text is": (
        "# 图以两倍尺寸绘制：在高分辨率屏幕上也清晰。图中文字为"
    ),
    "# 12 pt, and a figure 5.4 inches wide unless it says otherwise: on a phone, where": (
        "# 12磅，图宽5.4英寸（另有说明的除外）：在手机上，图会缩小到屏幕宽度，"
    ),
    "# a figure shrinks to the screen, its smallest label stays about 9 px tall.": (
        "# 其中最小的标签仍有约9像素高。"
    ),
}
# zh/chapters/ is one folder deeper than chapters/: the checkout is two folders up.
SETUP_PATH = (
    "    sys.path.insert(0, str(pathlib.Path.cwd().parent))",
    "    sys.path.insert(0, str(pathlib.Path.cwd().parents[1]))",
)
# The checkers speak Chinese in the Chinese notebooks (mha.exercises.set_language).
SETUP_LANGUAGE = (
    "import torch",
    'import torch\n\nimport mha.exercises\n\nmha.exercises.set_language("zh")  # 练习检查器用中文给出提示',
)


def chinese_setup_cell(english: str) -> str:
    """The setup cell of a Chinese notebook: tools/setup_cell.txt with Chinese comments, the
    checkout found from zh/chapters/, and the checkers switched to Chinese."""
    lines = []
    for line in english.split("\n"):
        if line.lstrip().startswith("# ") and line not in SETUP_COMMENTS:
            raise ValueError(
                f"translate this comment of tools/setup_cell.txt in SETUP_COMMENTS: {line!r}"
            )
        line = SETUP_COMMENTS.get(line, line)
        for old, new in (SETUP_PATH, SETUP_LANGUAGE):
            line = new if line == old else line
        lines.append(line)
    text = "\n".join(lines)
    missing = [new for _, new in (SETUP_PATH, SETUP_LANGUAGE) if new not in text]
    if missing:
        raise ValueError(
            f"tools/setup_cell.txt changed: cannot place {missing} (tools/translation_code.py)"
        )
    return text


CHECKER_LINE = re.compile(r"^✓ (check_\w+): correct — .*$", re.MULTILINE)


def run_checkers() -> dict[str, dict[str, str]]:
    """What every exercise checker prints for an answer it accepts, in English and in Chinese.

    Run in a fresh interpreter (`translate.py checker-lines`) on the checkout's `mha`, with Triton
    interpreted, so that the language switch and Triton's mode stay out of the caller's process.
    """
    env = {k: v for k, v in os.environ.items() if k != "MHA_LANG"}
    env.update(PYTHONPATH=str(REPO), TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().with_name("translate.py")), "checker-lines"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"running the checkers failed:\n{result.stderr}")
    return json.loads(result.stdout)


def checker_lines_here() -> dict[str, dict[str, str]]:
    """`translate.py checker-lines`: each checker run on its first declared variant, per language."""
    import mha.exercises as exercises  # here, not at the top: only this subprocess needs mha

    lines: dict[str, dict[str, str]] = {}
    for exercise in exercises.EXERCISES:
        lines[exercise.name] = {}
        for language in ("en", "zh"):
            exercises.set_language(language)
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    exercise.check(exercise.accepted_answer())
            except Exception as err:  # noqa: BLE001 (reported where a notebook needs the line)
                out.write(f"(could not run: {type(err).__name__}: {err})")
            # The success line only (a checker may print more before it).
            printed = out.getvalue().rstrip("\n").split("\n")
            lines[exercise.name][language] = next(
                (ln for ln in printed if ln.startswith("✓ ")), "\n".join(printed)
            )
    exercises.set_language("en")
    return lines


_CHECKERS: dict[str, dict[str, str]] = {}


def chinese_checker_output(text: str, where: str) -> str:
    """A stored stdout with every checker's success line replaced by what that checker prints in
    Chinese. The English line must be exactly what the checker prints now in English (else the
    stored notebook is out of date: make execute), so both lines are one result, two languages."""

    def swap(m: re.Match) -> str:
        if not _CHECKERS:
            _CHECKERS.update(run_checkers())
        lines = _CHECKERS.get(m.group(1))
        if lines is None or lines["en"] != m.group(0):
            raise ValueError(
                f"{where}: the stored line {m.group(0)!r} is not what {m.group(1)} prints now "
                f"({lines and lines['en']!r}); re-execute the notebook (make execute)"
            )
        return lines["zh"]

    return CHECKER_LINE.sub(swap, text)
