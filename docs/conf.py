"""Sphinx configuration for the jaxstrategy site: `make docs` builds it into docs/_build/html.

Sphinx with MyST-NB, as JAX, Flax and optax use: the guides are MyST Markdown, the notebooks in
notebooks/ render with their stored outputs (never executed here; tests/user_facing/test_notebooks.py runs
them), and the API reference is autodoc of the docstrings (Google style, through napoleon). The
build runs with `-W --keep-going -n`, so a warning or a broken reference fails it.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # jaxstrategy and jaxstrategy_pytest, installed or not

# The notebooks live in notebooks/ (tests/user_facing/test_notebooks.py executes them there); Sphinx reads
# only files under docs/, so each build takes a fresh copy of them.
_NOTEBOOKS = DOCS / "notebooks"
shutil.rmtree(_NOTEBOOKS, ignore_errors=True)
shutil.copytree(ROOT / "notebooks", _NOTEBOOKS, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))

import jaxstrategy  # noqa: E402  (after sys.path is set)

project = "jaxstrategy"
author = "the jaxstrategy authors"
copyright = "the jaxstrategy authors"
release = version = jaxstrategy.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "**.ipynb_checkpoints", "README.md"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

# The docstrings write code names in single backticks, as Markdown does.
default_role = "code"

# Notebooks show the outputs stored in them; the test suite is what executes them.
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Types from other libraries appear in signatures; without network access at build time there is
# no inventory to link them to, so they are not references this site can check.
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(jax|jaxlib|numpy|np|jnp|optax|flax|nnx|orbax|pytest|_pytest|collections|typing|types|signal|subprocess|os|enum|contextlib|threading|concurrent|pathlib|dataclasses|abc)(\..*)?",
    ),
]

html_theme = "furo"
html_title = f"jaxstrategy {release}"
# tables.css lets the wide tables wrap within the page instead of scrolling sideways.
html_static_path = ["_static"]
html_css_files = ["tables.css"]


# Public names by module. Signatures and docstrings name classes where they are defined
# (`jaxstrategy._src.values.options.RunOptions`) or bare (`StrategyContextError`); users know them by their
# public names, which is where their pages are.
_PUBLIC_MODULES = ("jaxstrategy", "jaxstrategy.checkpoint", "jaxstrategy.nn", "jaxstrategy.testing")


def _public_name(target: str) -> str | None:
    """`jaxstrategy._src.values.options.RunOptions` or `RunOptions` -> `jaxstrategy.RunOptions` (and the
    same for a member, `...Strategy.run` -> `jaxstrategy.Strategy.run`); None for other names."""
    import importlib

    parts = target.split(".")
    for index, part in enumerate(parts):
        for module_name in _PUBLIC_MODULES:
            if part in importlib.import_module(module_name).__all__:
                return ".".join([module_name, *parts[index:]])
    return None


def _resolve_public(app, env, node, contnode):
    """Point a reference to a private path or a bare public name at the public name's entry."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"]
    public = _public_name(target)
    if public is not None and public != target:
        domain = env.get_domain("py")
        for reftype in (node["reftype"], "obj"):
            resolved = domain.resolve_xref(env, node["refdoc"], app.builder, reftype, public, node, contnode)
            if resolved is not None:
                return resolved
    if target.startswith("jaxstrategy._src."):
        # A private helper type (a base class, an alias such as PyTree): shown as text.
        return contnode
    return None


def _attribute_docstring_without_inline_type(self):
    """Napoleon reads a property's first line "Summary: more" as "type: description"; ours never
    mean a type there (autodoc takes it from the annotation), so the whole docstring is the text."""
    lines = self._dedent(self._consume_to_end())
    return self.__class__(lines, self._config).lines()


from sphinx.ext.napoleon.docstring import GoogleDocstring  # noqa: E402

GoogleDocstring._parse_attribute_docstring = _attribute_docstring_without_inline_type


_CODE_THEN_LETTER = re.compile(r"(?<![`\\])(`[^`\s][^`]*`)(?=[\w(])")


def _markdown_backticks(app, what, name, obj, options, lines):
    """Docstrings write plurals such as `jax.Array`s, as Markdown allows; reST needs `jax.Array`\\ s."""
    del app, what, name, obj, options
    lines[:] = [_CODE_THEN_LETTER.sub(r"\1\\ ", line) for line in lines]


def _public_bases(app, name, obj, options, bases):
    """Show the bases a user can look up: no `object`, and a private base replaced by its bases."""
    del app, name, obj, options

    def public(base):
        if base is object:
            return []
        if base.__module__.startswith("jaxstrategy._src") and _public_name(base.__name__) is None:
            return [b for parent in base.__bases__ for b in public(parent)]
        return [base]

    bases[:] = list(dict.fromkeys(b for base in list(bases) for b in public(base)))


def setup(app):
    app.connect("autodoc-process-bases", _public_bases)
    app.connect("autodoc-process-docstring", _markdown_backticks)
    app.connect("missing-reference", _resolve_public)
