"""Data the course ships with the package.

``course_prose.txt``: the English prose of the course's own pages (code, formulas and markup
removed), the text section 4.4's character-level model learns from. It is built from
``chapters/text/*.md`` by ``tools/writer_text.py`` and shares the repository's licence (MIT).
Read it with :func:`mha.lab.writer.load_text` (``importlib.resources``, so that it is found in an
installed package, on Colab too).
"""
