"""Show the installed libraries' own source lines, so a chapter's root-cause claims cite real code."""
from __future__ import annotations

import inspect
import re


def source_lines(obj, pattern: str, before: int = 0, after: int = 0) -> str:
    """Lines of `obj`'s source matching the regex `pattern` (with context), prefixed by file:line."""
    obj = inspect.unwrap(obj)  # decorated functions (torch.no_grad, functools.wraps) show their own body
    lines, first = inspect.getsourcelines(obj)
    path = inspect.getsourcefile(obj)
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
