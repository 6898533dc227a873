"""The package's layout: attention code at the top of mha/, the instruments in mha/lab/, one way.

* ``import mha`` stays light, and ``mha.<name>`` is the lab's module itself (``mha.viz`` is
  ``mha.lab.viz``), loaded on first use;
* dependencies run one way: the attention code never imports the lab or the exercises, the lab
  never imports the exercises;
* a name has one home: no instrument re-exports another's functions or classes, and every chapter,
  test and tool imports a function or class from the module that defines it;
* no module of the package or of tools/ is longer than 800 lines (the Triton kernels excepted).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest

import mha
import mha.lab

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mha"
CORE = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
LAB = list(mha.lab.MODULES)
# The measuring side: the lab and the one decision of dtypes and kernels it shares with the core.
INSTRUMENTS = [f"mha.lab.{m}" for m in LAB] + ["mha.device"]
LONGEST = 800
LONGER_ALLOWED = {"triton_flash.py"}  # the Triton kernels, forward and backward, read as one


def test_import_mha_is_light():
    code = (
        "import sys, mha; "
        "print(sorted(m for m in sys.modules if m == 'matplotlib' or m.startswith('mha.lab.')"
        " or m == 'mha.exercises'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    # expect_error is part of mha's namespace, so its small module is loaded; nothing else is.
    assert result.stdout.strip() == "['mha.lab.demo']"


def test_the_lab_lists_its_modules():
    files = sorted(p.stem for p in (PACKAGE / "lab").glob("*.py") if not p.stem.startswith("_"))
    assert sorted(LAB) == files


@pytest.mark.parametrize("name", LAB)
def test_mha_name_is_the_lab_module_itself(name):
    module = importlib.import_module(f"mha.lab.{name}")
    assert getattr(mha, name) is module
    assert name in mha.__all__


def _imports(path: Path) -> list[str]:
    """The absolute names of the mha modules a file of the package imports."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names += [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n for n in names if n == "mha" or n.startswith("mha.")]


@pytest.mark.parametrize("name", CORE)
def test_the_core_imports_neither_the_lab_nor_the_exercises(name):
    bad = [
        n for n in _imports(PACKAGE / f"{name}.py") if n.startswith(("mha.lab", "mha.exercises"))
    ]
    assert not bad, f"mha/{name}.py imports {bad}: the attention code must not need them"


@pytest.mark.parametrize("path", sorted((PACKAGE / "lab").glob("*.py")), ids=lambda p: p.name)
def test_the_lab_does_not_import_the_exercises(path):
    assert not [n for n in _imports(path) if n.startswith("mha.exercises")]


@pytest.mark.parametrize("name", INSTRUMENTS)
def test_no_instrument_reexports_another(name):
    module = importlib.import_module(name)
    for attr, obj in vars(module).items():
        if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        home = obj.__module__
        assert home == name or home not in INSTRUMENTS, (
            f"{name}.{attr} is {home}.{attr}: import it from {home}, or under a private name"
        )
    for attr in getattr(module, "__all__", []):
        obj = getattr(module, attr)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert obj.__module__ == name, (
                f"{name}.__all__ lists {attr}, defined in {obj.__module__}"
            )


@pytest.mark.parametrize(
    "path",
    sorted([*PACKAGE.rglob("*.py"), *(ROOT / "tools").glob("*.py")]),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_module_is_longer_than_800_lines(path):
    if path.name in LONGER_ALLOWED:
        return
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= LONGEST, f"{path.relative_to(ROOT)} has {lines} lines: split it by concept"


# --- every chapter, test and tool imports a name from its home -------------------------------


def _code_cells(path: Path) -> str:
    """A chapter's code cells as one Python text; IPython's %magics and !commands become `pass`."""
    notebook = nbformat.read(path, as_version=4)
    cells = [c.source for c in notebook.cells if c.cell_type == "code"]
    return "\n".join(re.sub(r"^(\s*)[%!].*$", r"\1pass", c, flags=re.M) for c in cells)


def _sources() -> list[Path]:
    chapters = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
    return [
        *chapters,
        *sorted((ROOT / "tests").glob("*.py")),
        *sorted((ROOT / "tools").glob("*.py")),
    ]


def _attribute(dotted: str) -> object:
    """What ``mha.viz.tile_grid`` evaluates to (attribute by attribute, as Python does)."""
    first, *rest = dotted.split(".")
    obj: object = importlib.import_module(first)
    for part in rest:
        obj = getattr(obj, part)
    return obj


def _not_at_home(owner: object, attr: str) -> str | None:
    """Why ``owner.attr`` is the wrong path to a name (``None`` when it is the right one)."""
    if not hasattr(owner, attr):
        return "does not exist"
    obj = getattr(owner, attr)
    if not isinstance(owner, types.ModuleType) or hasattr(owner, "__path__"):
        return None  # a class attribute, or a package's own namespace (mha, mha.exercises)
    if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ != owner.__name__:
        return f"is defined in {obj.__module__}"
    return None


def _module(name: str) -> types.ModuleType | None:
    """The module ``name`` of this checkout's mha, or ``None`` if there is no such file.

    A shared environment may hold an editable install of another checkout, whose finder would
    answer for a module this checkout no longer has: only a file under this mha/ counts.
    """
    parent, _, child = name.rpartition(".")
    before = vars(sys.modules[parent]).get(child) if parent in sys.modules else None
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError:
        return None
    if not Path(module.__file__ or "").resolve().is_relative_to(PACKAGE):
        sys.modules.pop(name, None)  # not ours: forget it, and give its parent back its attribute
        setattr(sys.modules[parent], child, before)
        if before is None:
            delattr(sys.modules[parent], child)
        return None
    return module


def _wrong_imports(tree: ast.AST, aliases: dict[str, object]) -> list[str]:
    """Imports of mha modules that do not exist, or of names from a module that is not their home.

    Fills ``aliases`` (local name -> module) with the modules imported by ``from ... import``.
    """
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names if a.name.split(".")[0] == "mha"]
            names: list[ast.alias] = []
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mha":
            modules, names = [node.module], node.names
        else:
            continue
        for module in modules:  # an import statement imports modules, never attributes
            owner = _module(module)
            if owner is None:
                wrong.append(f"{module}: no such module")
                names = []
        for a in names:
            if hasattr(owner, "__path__") and not hasattr(owner, a.name):
                _module(f"{node.module}.{a.name}")  # `from package import module` imports it
            why = _not_at_home(owner, a.name)
            if why:
                wrong.append(f"from {node.module} import {a.name}: {why}")
            elif isinstance(getattr(owner, a.name), types.ModuleType):
                aliases[a.asname or a.name] = getattr(owner, a.name)
    return wrong


def _wrong_attributes(tree: ast.AST, aliases: dict[str, object]) -> list[str]:
    """``mha.<module>.<name>`` (or ``<alias>.<name>``) where the module is not the name's home."""
    wrong = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, base = [node.attr], node.value
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if not isinstance(base, ast.Name):
            continue
        *path, attr = [base.id, *reversed(chain)]
        if path[0] == "mha":
            try:
                owner = _attribute(".".join(path))
            except AttributeError:
                continue  # reported for its own, shorter chain
        elif path[0] in aliases and len(path) == 1:
            owner = aliases[path[0]]
        else:
            continue
        why = _not_at_home(owner, attr)
        if why:
            wrong.append(f"{'.'.join([*path, attr])}: {why}")
    return wrong


@pytest.mark.parametrize("path", _sources(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_names_are_used_from_their_home_module(path):
    text = _code_cells(path) if path.suffix == ".ipynb" else path.read_text(encoding="utf-8")
    tree, aliases = ast.parse(text), {}
    assert _wrong_imports(tree, aliases) + _wrong_attributes(tree, aliases) == []
