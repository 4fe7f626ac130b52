"""Show the installed libraries' own source lines, so a chapter's root-cause claims cite real code."""
from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path


def _display_path(obj, path: str) -> str:
    """`path` relative to the folder holding `obj`'s top-level package (`trl/trainer/grpo_trainer.py`)."""
    module = inspect.getmodule(obj)
    top = sys.modules.get(module.__name__.partition(".")[0]) if module else None
    top_file = getattr(top, "__file__", None)
    if top_file:
        top_path = Path(top_file).resolve()
        base = top_path.parent.parent if top_path.name == "__init__.py" else top_path.parent
        try:
            return Path(path).resolve().relative_to(base).as_posix()
        except ValueError:
            pass
    return Path(path).name


def source_lines(obj, pattern: str, before: int = 0, after: int = 0) -> str:
    """Lines of `obj`'s source matching the regex `pattern` (with context), prefixed by file:line.

    The file is named relative to its package's folder, as in `accelerate/accelerator.py`.
    """
    obj = inspect.unwrap(obj)  # decorated functions (torch.no_grad, functools.wraps) show their own body
    lines, first = inspect.getsourcelines(obj)
    path = _display_path(obj, inspect.getsourcefile(obj))
    keep = set()
    for i, line in enumerate(lines):
        if re.search(pattern, line):
            keep.update(range(max(0, i - before), min(len(lines), i + after + 1)))
    if not keep:
        raise LookupError(f"{pattern!r} does not occur in {obj.__qualname__} ({path}); the library changed.")
    shown, previous = [], None
    for i in sorted(keep):
        if previous is not None and i != previous + 1:
            shown.append("    ...")
        shown.append(f"{first + i:>5} | {lines[i].rstrip()}")
        previous = i
    return f"{path}\n" + "\n".join(shown)


def assignment_conditions(obj, target: str) -> list[list[str]]:
    """For each assignment to `target` (e.g. "self.scaler") in `obj`'s source, the `if` tests that must
    hold for it to run, outermost first (a test that must fail reads `not (...)`).

    Read from the installed source's syntax tree, so it answers "which flag builds this?" on any device.
    """
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(obj))))
    found = []

    def visit(node, conditions):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(ast.unparse(t) == target for t in targets):
                found.append(list(conditions))
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            for child in node.body:
                visit(child, conditions + [test])
            for child in node.orelse:
                visit(child, conditions + [f"not ({test})"])
            return
        for child in ast.iter_child_nodes(node):
            visit(child, conditions)

    visit(tree, [])
    return found
