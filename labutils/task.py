"""The verifiable task: a stride walk modulo 10, solved on a scratchpad whose length is a dial.

The prompt ``3+7*4=`` asks for (3 + 7*4) mod 10. The completion adds the stride once per step,
counting down the steps left, then states the answer:

    4:3+7=0;3:0+7=7;2:7+7=4;1:4+7=1;1

Every step depends only on the step before it, so a tiny model learns the procedure quickly,
yet one slip anywhere spoils the answer: longer walks are harder. The number of steps dials
the completion from 9 tokens (one step) to over 1,000 (111 steps and more).
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    start: int
    stride: int
    steps: int

    @property
    def prompt(self) -> str:
        return f"{self.start}+{self.stride}*{self.steps}="

    @property
    def answer(self) -> str:
        return str((self.start + self.stride * self.steps) % 10)

    @property
    def completion(self) -> str:
        parts, value = [], self.start
        for left in range(self.steps, 0, -1):
            new = (value + self.stride) % 10
            parts.append(f"{left}:{value}+{self.stride}={new};")
            value = new
        return "".join(parts) + str(value)


def completion_length(steps: int) -> int:
    """Characters (= tokens) in the completion of a walk of `steps` steps, EOS excluded."""
    if steps < 1:
        raise ValueError(f"a walk needs at least 1 step, got {steps}.")
    return sum(7 + len(str(left)) for left in range(1, steps + 1)) + 1


def steps_for_length(tokens: int) -> int:
    """Fewest steps whose completion is at least `tokens` long."""
    steps = 1
    while completion_length(steps) < tokens:
        steps += 1
    return steps


def sample_problems(rng: random.Random, count: int, min_steps: int, max_steps: int,
                    exclude: frozenset = frozenset(), distinct: bool = False) -> list[Problem]:
    """`count` problems: random start and stride digits, steps uniform in [min_steps, max_steps].

    Problems in `exclude` are redrawn; with `distinct` no problem appears twice.
    """
    if not 1 <= min_steps <= max_steps:
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}.")
    space = 100 * (max_steps - min_steps + 1) - len({p for p in exclude if min_steps <= p.steps <= max_steps})
    if space < (count if distinct else 1):
        raise ValueError(f"only {space} problems have {min_steps}–{max_steps} steps outside `exclude`; "
                         f"{count} {'distinct ' if distinct else ''}were asked for.")
    found: list[Problem] = []
    seen = set(exclude)
    while len(found) < count:
        problem = Problem(rng.randrange(10), rng.randrange(10), rng.randint(min_steps, max_steps))
        if problem in seen:
            continue
        if distinct:
            seen.add(problem)
        found.append(problem)
    return found


def final_answer(completion: str) -> str:
    """The answer a completion commits to: the text after its last ';' (or all of it)."""
    return completion.strip().rsplit(";", 1)[-1]


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer equals the true one, else 0.0."""
    return float(final_answer(completion) == answer)
