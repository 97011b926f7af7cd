"""Sphinx configuration for the shardweave documentation (build: ``nox -s docs``)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The docs session installs the four packages; these paths also let a plain
# `sphinx-build docs docs/_build/html` work from a checkout with torch installed.
for pkg in ("mesh", "fsdp", "replicate", "extensions"):
    sys.path.insert(0, str(ROOT / "packages" / pkg / "src"))

project = "shardweave"
author = "shardweave contributors"
copyright = "shardweave contributors"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# API pages use `automodule :members:`, which documents exactly each module's `__all__`, so a
# name added to `__all__` appears without touching the docs.
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "groupwise"
autodoc_typehints = "description"
autodoc_class_signature = "separated"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

myst_heading_anchors = 3
html_theme = "alabaster"
html_title = "shardweave"
