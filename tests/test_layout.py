"""The package's shape (issue 16): no import cycles, function-level imports included, and private
names cross modules only where listed below."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxsane"

# Private names that still cross modules, each with its reason. Keep this list short: a helper that
# several modules need gets a public name in an honestly named shared module instead.
ALLOWED_PRIVATE: set[tuple[str, str, str]] = set()
MAX_PRIVATE = 10


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def import_graph(package: pathlib.Path = PACKAGE):
    """``(edges, private)``: module -> the package modules it imports (at any level of the file, except
    under ``if TYPE_CHECKING``), and every ``(importer, module, _name)`` private name that crosses."""
    edges: dict[str, set[str]] = {}
    private: set[tuple[str, str, str]] = set()
    for path in sorted(package.glob("*.py")):
        name = path.stem
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        module_aliases: dict[str, str] = {}
        targets = edges.setdefault(name, set())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or _type_checking_only(node, parents):
                continue
            if node.level == 1 and node.module is None:          # from . import _x as _y
                for alias in node.names:
                    targets.add(alias.name)
                    module_aliases[alias.asname or alias.name] = alias.name
            elif node.level == 1 or (node.level == 0 and (node.module or "").startswith("jaxsane.")):
                module = node.module.split(".")[-1] if node.level == 0 else node.module.split(".")[0]
                targets.add(module)
                private |= {(name, module, a.name) for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")}
        for node in ast.walk(tree):  # _mod._name through a module alias
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in module_aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                private.add((name, module_aliases[node.value.id], node.attr))
    edges.pop("__init__", None)  # re-exports only, loaded lazily by name
    return {k: {v for v in vs if v != "__init__" and v != k} for k, vs in edges.items()}, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
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


def test_the_graph_reader_sees_cycles_and_private_names(tmp_path):
    (tmp_path / "_a.py").write_text("from ._b import x\n")
    (tmp_path / "_b.py").write_text("def f():\n    from ._a import _hidden\n")
    (tmp_path / "_c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._a import y\n"
                                    "from . import _b as _bb\nz = _bb._secret\n")
    edges, private = import_graph(tmp_path)
    assert cycles(edges) == [["_a", "_b"]]  # a function-level import closes the cycle
    assert ("_c", "_a") not in {(k, v) for k, vs in edges.items() for v in vs}  # TYPE_CHECKING only
    assert private == {("_b", "_a", "_hidden"), ("_c", "_b", "_secret")}
    (tmp_path / "_b.py").write_text("x = 1\n")  # the function-level import removed: no cycle
    assert cycles(import_graph(tmp_path)[0]) == []


def test_no_import_cycles():
    edges, _ = import_graph()
    assert len(edges) > 20  # the reader found the package
    assert cycles(edges) == []


def test_private_names_cross_modules_only_where_listed():
    _, private = import_graph()
    assert len(ALLOWED_PRIVATE) <= MAX_PRIVATE
    assert private - ALLOWED_PRIVATE == set(), "give these shared helpers public names in a shared module"


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_every_module_says_what_it_is(path):
    tree = ast.parse(path.read_text())
    assert ast.get_docstring(tree), f"{path.name} needs a module docstring of a few lines"


MAX_LINES = 520


def test_modules_stay_under_about_500_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    too_big = {name for name, n in sizes.items() if n > MAX_LINES}
    assert not too_big, f"split these along their seams: {sorted(too_big)}"
