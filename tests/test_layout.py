"""The package's shape (issue 28): capability folders in an explicit layer order, imports that point
down only, no cycle of modules or of folders (function-level and ``TYPE_CHECKING`` imports included),
no private name crossing folders, short files and short functions."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxsane"

# Bottom to top. A module may import from its own folder and from folders below it, never above.
LAYERS = (
    "_core",
    "_jaxpr",
    "_render",
    "_experiment",
    "_dump",
    "_dist",
    "_locate",
    "_precision",
    "_guard",
    "_data",
    "_checks",
    "_monitor",
    "_overfit",
    "_fit",
    "_doctor",
)
# The public faces at the root: they may import from any folder.
ROOT_MODULES = {"__init__", "__main__", "cli", "testing", "pytest_plugin"}  # __main__: python -m jaxsane
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 100


def module_name(path: pathlib.Path, package: pathlib.Path) -> str:
    """``_core.tree`` for ``jaxsane/_core/tree.py``; ``_core`` for its ``__init__.py``."""
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str | None:
    """The absolute module (inside the package, without ``jaxsane.``) that a relative import names."""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if level - 1 > len(base):
        return None
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, *(module.split(".") if module else [])])


def import_graph(package: pathlib.Path = PACKAGE):
    """``(edges, private)``: module -> the package modules it imports anywhere in the file (function
    level and ``TYPE_CHECKING`` included), and every ``(importer, module, _name)`` private name that
    crosses from one folder into another."""
    modules = {module_name(p, package): p for p in package.rglob("*.py") if "examples" not in p.parts}
    edges: dict[str, set[str]] = {}
    private: set[tuple[str, str, str]] = set()
    for name, path in sorted(modules.items()):
        tree = ast.parse(path.read_text())
        targets = edges.setdefault(name, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    target = _resolve(name, path.name == "__init__.py", node.level, node.module)
                elif (node.module or "").startswith("jaxsane."):
                    target = node.module[len("jaxsane.") :]
                else:
                    continue
                if target is None:
                    continue
                for alias in node.names:  # `from ._core import tree` names a module
                    sub = f"{target}.{alias.name}" if target else alias.name
                    hit = sub if sub in modules else target
                    if hit in modules or hit == "":
                        targets.add(hit)
                    if alias.name.startswith("_") and not alias.name.startswith("__") and folder(hit) != folder(name):
                        private.add((name, hit, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("jaxsane."):
                        targets.add(alias.name[len("jaxsane.") :])
    return {k: {v for v in vs if v not in ("", k)} for k, vs in edges.items()}, private


def folder(module: str) -> str:
    """The capability folder a module lives in (``_core``), or the module itself at the root."""
    return module.split(".")[0]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def folder_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, bs in edges.items():
        out.setdefault(folder(a), set()).update(folder(b) for b in bs if folder(b) != folder(a))
    return out


def upward_imports(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a folder into a folder above it in :data:`LAYERS` (or into a root module)."""
    rank = {f: i for i, f in enumerate(LAYERS)}
    bad = []
    for a, bs in sorted(edges.items()):
        if folder(a) in ROOT_MODULES:
            continue
        for b in sorted(bs):
            if folder(b) == folder(a):
                continue
            if folder(b) not in rank or folder(a) not in rank or rank[folder(b)] > rank[folder(a)]:
                bad.append((a, b))
    return bad


def test_the_graph_reader_sees_cycles_layers_and_private_names(tmp_path):
    for sub in ("_core", "_guard"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "__init__.py").write_text('"""x"""\n')
    (tmp_path / "_core" / "a.py").write_text("from .b import x\n")
    (tmp_path / "_core" / "b.py").write_text("def f():\n    from .a import y\n")  # function level closes a cycle
    (tmp_path / "_guard" / "g.py").write_text("from .._core.a import _hidden\n")
    (tmp_path / "_core" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .._guard import g\n"
    )
    edges, private = import_graph(tmp_path)
    assert cycles(edges) == [["_core.a", "_core.b"]]
    assert "_guard.g" in edges["_core.c"]  # TYPE_CHECKING imports count
    assert private == {("_guard.g", "_core.a", "_hidden")}
    assert upward_imports(edges) == [("_core.c", "_guard.g")]
    assert cycles(folder_edges(edges)) == [["_core", "_guard"]]
    (tmp_path / "_core" / "b.py").write_text("x = 1\n")
    (tmp_path / "_core" / "c.py").write_text("x = 1\n")
    edges, _ = import_graph(tmp_path)
    assert cycles(edges) == [] and upward_imports(edges) == [] and cycles(folder_edges(edges)) == []


def test_every_capability_has_its_folder_and_the_root_holds_only_the_public_faces():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert sorted(set(folders) - {"examples"}) == sorted(LAYERS)
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    assert loose == ROOT_MODULES


def test_no_import_cycle_between_modules():
    edges, _ = import_graph()
    assert len(edges) > 60  # the reader found the package
    assert cycles(edges) == []


def test_no_import_cycle_between_folders():
    assert cycles(folder_edges(import_graph()[0])) == []


def test_imports_point_down_the_layers():
    assert upward_imports(import_graph()[0]) == []


def test_no_private_name_crosses_folders():
    _, private = import_graph()
    assert private == set(), "give these shared helpers public names in the folder that owns them"


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "examples" not in p.parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_says_what_it_is(path):
    assert ast.get_docstring(ast.parse(path.read_text())), f"{path} needs a module docstring of a few lines"


def test_no_file_over_600_lines():
    too_big = {
        str(p.relative_to(PACKAGE)): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not too_big, f"split these where the idea divides: {too_big}"


def test_no_function_over_100_lines():
    long = {}
    for p in MODULES:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(PACKAGE)}:{node.name}"] = n
    assert not long, f"split these: {long}"


def test_every_public_exception_is_defined_in_the_errors_module():
    import jaxsane

    for name in jaxsane.__all__:
        value = getattr(jaxsane, name)
        if isinstance(value, type) and issubclass(value, (Exception, Warning)):
            assert value.__module__ == "jaxsane._core.errors", name
    defined = [
        n.name
        for n in ast.walk(ast.parse((PACKAGE / "_core" / "errors.py").read_text()))
        if isinstance(n, ast.ClassDef)
    ]
    assert set(defined) <= set(jaxsane.__all__), "every exception and warning is exported"
    internal = {("cli.py", "UsageError")}  # the command line's exit-2 signal; it never reaches a library user
    for p in MODULES:
        if p.name != "errors.py":
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Warning")):
                    if (p.name, node.name) in internal:
                        continue
                    pytest.fail(f"{p.relative_to(PACKAGE)} defines {node.name}: put it in _core/errors.py")


def test_the_type_checking_block_names_every_public_name():
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))
    names = {a.asname or a.name for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    import jaxsane

    assert names == set(jaxsane.__all__)
