"""Sphinx extension: every script in a page's <head> once.

Sphinx 7.4 writes an inline script twice when an extension registers it after the HTML builder
started (on `builder-inited` or later): the builder keeps its copy (file name None) and, when it
prepares to write, adds the registry's copy again as file name "", which its duplicate check
does not see as the same script. Two of Jupyter Book 1's extensions do that: sphinx-thebe 0.3.1
(`const THEBE_JS_URL = ...`, on `env-before-read-docs`: the second copy stops with "Identifier
'THEBE_JS_URL' has already been declared" on every page) and sphinx-togglebutton 0.4.5
(`var togglebuttonSelector = ...`, on `builder-inited`).

This extension drops the second copy of any script (same file or same inline body, same
attributes) from each page's list before the page is written, keeping the first in its place.
tests/test_book_html.py fails a page that carries a script twice.
"""

from __future__ import annotations


def script_key(script) -> tuple:
    """What makes two of the builder's scripts the same: file (None and "" alike), attributes."""
    filename = getattr(script, "filename", script) or ""
    attributes = getattr(script, "attributes", {})
    return (str(filename), tuple(sorted((k, str(v)) for k, v in attributes.items())))


def one_copy_each(app, pagename, templatename, context, doctree) -> None:
    scripts = context.get("script_files")
    if not scripts:
        return
    seen: set[tuple] = set()
    unique = []
    for script in scripts:
        key = script_key(script)
        if key not in seen:
            seen.add(key)
            unique.append(script)
    # In place: the list is the builder's own, restored before each page.
    scripts[:] = unique


def setup(app):
    # After every other handler, which may add a page's own scripts (myst-nb does).
    app.connect("html-page-context", one_copy_each, priority=999)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
