"""The two packages' boundary: chapters' helpers (labutils) never import the build (bookbuild), and
no module imports itself back through another, at module level or inside a function."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("labutils", "bookbuild")


def imports(path: Path, package: str) -> set[str]:
    """The project modules that the file at `path`, inside `package`, imports anywhere in its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = package if node.level == 1 else node.module or ""
        if node.level == 1 and node.module:
            found.add(f"{package}.{node.module}")
        elif base in PACKAGES:
            found |= {f"{base}.{alias.name}" for alias in node.names}
        elif base.split(".")[0] in PACKAGES:
            found.add(base)
    return found


def graph() -> dict[str, set[str]]:
    modules = {f"{p}.{f.stem}": (f, p) for p in PACKAGES for f in (ROOT / p).glob("*.py")}
    return {name: imports(f, p) & set(modules) - {name} for name, (f, p) in modules.items()}


def cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle, as the modules along it, or [] where there is none."""
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = "done"
        return []

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_remains():
    assert cycle(graph()) == []


def test_labutils_never_imports_the_build():
    leaks = {(m, d) for m, deps in graph().items() for d in deps if m.startswith("labutils") and d.startswith("bookbuild")}
    assert not leaks
