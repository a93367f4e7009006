"""The documentation site builds without a warning, and documents every public name.

`mkdocs build --strict` (warnings are errors: a broken link or anchor, a
mkdocstrings reference that does not resolve, a docstring griffe cannot read)
builds the site of mkdocs.yml into a temporary directory, once for this module;
a failure shows mkdocs' own output. mkdocs and its plugins are test
requirements (the ``test`` extra includes the ``docs`` one): when they are
missing the tests fail with the install command, they are not skipped.

Then, on the built site:

* every name of ``kdp.__all__`` has its entry (an HTML anchor named by its full
  path) in the API reference, under the module that defines it, and so has
  every public submodule of kdp and every name in a submodule's ``__all__``;
* every stored notebook is a page, and the design index links every design note;
* README.md (outside the site, so not checked by mkdocs) links only to files
  that exist.
"""

import ast
import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KDP = ROOT / "kdp"
BUILD_TIMEOUT_S = 600
_ID = re.compile(r'\bid="([^"]+)"')
_HREF = re.compile(r'\bhref="([^"#]*)(?:#[^"]*)?"')
_MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
#: names a module's ``__all__`` lists that the module does not define (nothing to
#: document; ``from module import *`` fails on them): none
NOT_DEFINED = {}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    missing = [m for m in ("mkdocs", "material", "mkdocstrings_handlers.python", "mkdocs_jupyter")
               if importlib.util.find_spec(m.split(".")[0]) is None]
    assert not missing, (f"the docs' requirements are missing ({', '.join(missing)}): "
                         'pip install -e ".[docs]"')
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    output = f"{build.stdout}\n{build.stderr}"
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{output[-12000:]}"
    return out


def _ids(site, folder="reference"):
    """The HTML anchors of every page under ``folder``."""
    ids = set()
    for page in (site / folder).rglob("*.html"):
        ids.update(html.unescape(i) for i in _ID.findall(page.read_text(encoding="utf-8")))
    return ids


def _source(module):
    """The source file of ``kdp.<module>`` (a module or a package)."""
    path = KDP / f"{module}.py"
    return path if path.exists() else KDP / module / "__init__.py"


def public_submodules():
    """kdp's public submodules: the modules and packages of kdp/ not starting with _."""
    names = [p.stem for p in KDP.glob("*.py")] + [p.name for p in KDP.iterdir()
                                                   if (p / "__init__.py").exists()]
    return sorted(n for n in set(names) if not n.startswith("_"))


def declared_all(path):
    """The literal ``__all__`` of a source file, or ``None``."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                return None
    return None


def kdp_public_names():
    """``{name: defining module}`` of ``kdp.__all__`` (a submodule maps to itself)."""
    tree = ast.parse((KDP / "__init__.py").read_text(encoding="utf-8"))
    return next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == "_SOURCES" for t in n.targets))


def test_site_builds(site):
    assert (site / "index.html").exists()
    assert (site / "reference" / "index.html").exists()


def test_kdp_all_is_in_the_reference(site):
    import kdp

    sources = kdp_public_names()
    assert sorted(sources) == sorted(kdp.__all__)
    ids = _ids(site)
    missing = [name for name, module in sources.items()
               if (module if module == f"kdp.{name}" else f"{module}.{name}") not in ids]
    assert not missing, f"kdp.__all__ names without an entry in the API reference: {missing}"


def test_public_submodules_are_in_the_reference(site):
    ids = _ids(site)
    modules = public_submodules()
    assert {"model", "layers", "losses", "training", "privacy", "accounting"} <= set(modules)
    missing = [m for m in modules if f"kdp.{m}" not in ids]
    assert not missing, f"public submodules without a page in the API reference: {missing}"
    pages = {p.parent.name for p in (site / "reference").glob("*/index.html")}
    assert set(modules) <= pages, f"one reference page per public module: {set(modules) - pages}"


def test_submodule_names_are_in_the_reference(site):
    """Every name of a public submodule's ``__all__`` has an entry on that module's
    page, under the module or one of its submodules."""
    missing = []
    for module in public_submodules():
        names = declared_all(_source(module)) or []
        page = site / "reference" / module / "index.html"
        ids = {html.unescape(i) for i in _ID.findall(page.read_text(encoding="utf-8"))}
        prefix = f"kdp.{module}"
        missing += [f"{prefix}.{n}" for n in names if f"{prefix}.{n}" not in NOT_DEFINED
                    and not any(i.startswith(prefix) and (i == f"{prefix}.{n}" or i.endswith(f".{n}"))
                                for i in ids)]
    assert not missing, f"public names without an entry in the API reference: {missing}"


def test_notebooks_and_design_notes_are_pages(site):
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks and all((site / "notebooks" / n / "index.html").exists() for n in notebooks)
    index = (site / "design" / "index.html").read_text(encoding="utf-8")
    links = {h.rstrip("/").split("/")[-1] for h in _HREF.findall(index)}
    notes = [p.stem for p in (ROOT / "docs" / "design").glob("*.md") if p.stem != "index"]
    assert all(n in links for n in notes), f"design notes not linked from design/index.md: {notes}"


def test_readme_links_exist():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t.split("#")[0] for t in _MD_LINK.findall(text)
               if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert targets, "README.md links into the documentation"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
