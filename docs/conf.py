"""Sphinx configuration of the jaxsane manual (``make docs``).

Sphinx with MyST pages (myst-nb), autosummary and autodoc over Google-style docstrings (napoleon):
what optax and flax use, and what jaxsane's docstrings are already written for (reST roles inside
Google sections). The theme is sphinx-book-theme, as optax and flax use: a JAX user finds the same
left-hand navigation, right-hand page outline and code-block styling there, and it renders myst-nb
notebook outputs (HTML tables, PNG plots) without extra CSS.

Notebooks are rendered from their committed outputs (``nb_execution_mode = "off"``); they live in
``notebooks/`` and are copied into ``docs/notebooks/`` (ignored by git) when the build starts.
The finding-code and doctor-option references are generated from ``jaxsane.CODES`` and
``jaxsane._doctor.options`` by the small extension in ``docs/_ext/jaxsane_docs.py``.
"""

from __future__ import annotations

import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # the checkout's jaxsane, also without an editable install
sys.path.insert(0, str(DOCS / "_ext"))

import jaxsane  # noqa: E402

project = "jaxsane"
author = "the jaxsane authors"
copyright = "the jaxsane authors"
release = version = jaxsane.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_nb",
    "jaxsane_docs",
]

exclude_patterns = ["_build", "**.ipynb_checkpoints", "_templates"]
templates_path = ["_templates"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"

# References inside docstrings that name private modules or third-party types do not resolve; the
# docstrings are the code owners', so they are not checked name by name (see the docs commit).
nitpicky = False

# autodoc / autosummary / napoleon
autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# types beside the parameters a docstring documents; a dataclass's fields are its Attributes already
autodoc_typehints_description_target = "documented_params"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True
# ``Attributes:`` sections as fields of their class: an attribute that is also a documented property
# (``Guarded.hang``) would otherwise be described twice.
napoleon_use_ivar = True

# MyST and notebooks
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # render the committed outputs; never re-execute
nb_merge_streams = True

# HTML
html_theme = "sphinx_book_theme"
html_title = f"jaxsane {version}"
html_static_path = ["_static"]
html_css_files = ["jaxsane.css"]
html_theme_options = {
    "repository_url": "https://github.com/jaxsane/jaxsane",
    "use_repository_button": True,
    "path_to_docs": "docs",
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
