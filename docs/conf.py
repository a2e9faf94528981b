"""Sphinx configuration: the markdown guides (myst-parser) and an API reference from docstrings (autodoc).

Build: ``./dev docs`` (or ``sphinx-build -W -b html docs build/docs``). Warnings are errors in
tests/test_docs.py, so a broken link, a missing page or a docstring that no longer renders fails CI.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

project = "fxkern"
author = "fxkern developers"
copyright = "fxkern developers"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3
html_theme = "alabaster"
html_static_path: list[str] = []

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
