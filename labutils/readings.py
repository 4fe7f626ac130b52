"""Hand-written readings of a chapter's numbers, and the checks that the numbers still support them.

A chapter writes what its numbers show by hand and glues the numbers into the sentence. Where the
outcome can only go one way, `support` stops the build the day the numbers no longer back the sentence.
Where it can go either way, `pick` glues whichever of two written readings the numbers support. Both
take the condition as a plain bool computed in the chapter from its recorded numbers and their
standard errors, so a test can feed either side of it.
"""
from __future__ import annotations

import os

from . import profiles


class Unsupported(AssertionError):
    """The numbers of this build no longer support a sentence the chapter prints."""


def support(claim: str, holds: bool, numbers: str = "") -> None:
    """Stop the chapter, naming the sentence, when `holds` is false (`numbers`: the values that decided it).
    In the gpu profile's code-path run on the CPU (every size at its minimum) nothing is checked: that run
    tests that the code runs, and its few tokens and steps support no sentence."""
    if not holds and not os.environ.get(profiles.GPU_PATHS_ON_CPU):
        detail = f" ({numbers})" if numbers else ""
        raise Unsupported(f"The numbers of this run no longer support the sentence {claim!r}{detail}: "
                          f"rewrite the paragraph for what the run shows, or find what changed.")


def pick(name: str, holds: bool, if_true: str, if_false: str) -> None:
    """Glue under `name` the reading the numbers support: `if_true` when `holds`, else `if_false` (returns
    nothing, so that a cell ending with it prints nothing)."""
    glue(name, if_true if holds else if_false)


def glue(name: str, value) -> None:
    """`myst_nb.glue` without output, for a number or a reading that the prose shows in place."""
    from myst_nb import glue as myst_glue

    myst_glue(name, value, display=False)


def glue_all(**values) -> None:
    """Glue each keyword's value under its name (numbers the hand-written paragraphs show)."""
    for name, value in values.items():
        glue(name, value)


def differs(a: float, a_se: float, b: float, b_se: float, z: float = 1.96) -> bool:
    """Whether two independent estimates differ beyond `z` standard errors of their difference (95% by default)."""
    return abs(a - b) > z * (a_se**2 + b_se**2) ** 0.5

