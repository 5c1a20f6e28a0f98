"""Reward functions: exact answers for the synthetic tasks, math-verify for math.

Each returns ``(reward, correct)``: ``correct`` is the exact-match accuracy, ``reward`` may give partial credit so a
tiny model's GRPO has a denser signal (addition: 0.5 x the fraction of right digits when the answer is wrong).
"""

from __future__ import annotations

import functools


def _digit_credit(response: str, answer: str) -> float:
    """Fraction of the answer's characters matched position by position (right-aligned: units digit first)."""
    r, a = response.strip()[::-1], answer[::-1]
    if not r:
        return 0.0
    hits = sum(1 for i, c in enumerate(a) if i < len(r) and r[i] == c)
    return hits / max(len(a), len(r))


def addition_reward(response: str, answer: str) -> tuple[float, bool]:
    """1 for the exact sum; else 0.5 x the fraction of right digits (right-aligned; extra digits count against)."""
    if response.strip() == answer:
        return 1.0, True
    return 0.5 * _digit_credit(response, answer), False


def sort_reward(response: str, answer: str) -> tuple[float, bool]:
    """1 for the sorted string; else 0.5 x the fraction of positions that hold the right digit."""
    r = response.strip()
    if r == answer:
        return 1.0, True
    hits = sum(1 for x, y in zip(r, answer, strict=False) if x == y)
    return 0.5 * hits / max(len(answer), len(r), 1), False


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str):
    from math_verify import parse

    gold = parse(f"${answer}$")
    return gold if gold else parse(answer)


def math_reward(response: str, answer: str) -> tuple[float, bool]:
    """math-verify: parse the response's final answer (boxed or last expression) and compare symbolically."""
    from math_verify import parse, verify

    try:
        pred = parse(response)
        ok = bool(pred) and bool(verify(_parse_gold(answer), pred))
    except Exception:  # math-verify raises on malformed LaTeX; an unparsable answer earns nothing
        ok = False
    return (1.0 if ok else 0.0), ok
