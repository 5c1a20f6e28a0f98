"""A synthetic long-response task: count from a start by a step, writing every term out.

Why this task: the addition and sort tasks answer in a handful of tokens, so they cannot exercise long rollouts.
Here the response is long by construction (``num_terms`` terms of ``term_digits`` digits, one space each), its
length is set by one parameter (from ~256 to 4K tokens and more), and correctness needs every token: one wrong digit
anywhere makes the answer wrong. Each term is the previous one plus a step of 1..9 (with carries), a local rule that
a 50-300M model learns from scratch after a short supervised warm start, and the verifier is exact and cheap.

``"count 0012 by 3 to 0021:"`` -> ``"0012 0015 0018 0021\\n"``.
"""

from __future__ import annotations

import random

from jetrl_megatron.rl.tasks.base import CharTokenizer, Prompt, SyntheticTask


def count_reward(response: str, answer: str) -> tuple[float, bool]:
    """Dense exact credit: the fraction of leading terms that match, over ``max(terms expected, fields given)``.

    Why dense: a policy that counts right for a while before slipping should score above one that slips at once,
    or GRPO on 4K-token answers would see almost no signal. Why strict: the response is split on single spaces with
    no trimming, so a doubled space or a stray character ends the correct prefix, and fields past the end count
    against the reward, so running on never pays. ``correct`` is exact equality with the answer."""
    expected = answer.split(" ")
    fields = response.split(" ") if response else []
    hits = 0
    for got, want in zip(fields, expected, strict=False):
        if got != want:
            break
        hits += 1
    correct = response == answer
    return (1.0 if correct else hits / max(len(expected), len(fields))), correct


class CountTask(SyntheticTask):
    """``"count s by d to e:"`` -> the terms ``s, s+d, ..., e``, zero-padded to ``term_digits``, space-separated.

    A response takes ``num_terms * (term_digits + 1)`` tokens with the character tokenizer (digits and a space per
    term, the last space replaced by end-of-sequence); ``terms_for_response_tokens`` picks ``num_terms`` for a
    target length. Prompts are a deterministic function of ``seed``."""

    name = "synthetic_count"

    def __init__(self, num_terms: int, term_digits: int = 4, num_prompts: int = 4096, seed: int = 0):
        if num_terms < 1 or term_digits < 1 or num_prompts < 1:
            raise ValueError(f"CountTask: num_terms={num_terms}, term_digits={term_digits} and "
                             f"num_prompts={num_prompts} must all be >= 1")
        self.tokenizer = CharTokenizer()
        self.num_terms, self.term_digits = num_terms, term_digits
        self._pairs = self._draw(random.Random(seed), num_prompts)

    @staticmethod
    def terms_for_response_tokens(response_tokens: int, term_digits: int = 4) -> int:
        """The ``num_terms`` whose responses take ``response_tokens`` tokens (rounded down; at least one term)."""
        return max(1, response_tokens // (term_digits + 1))

    def _max_step(self) -> int:
        """The largest step <= 9 whose ``num_terms`` terms fit in ``term_digits`` digits from a start of 0."""
        span = 10**self.term_digits - 1
        max_d = 9 if self.num_terms == 1 else min(9, span // (self.num_terms - 1))
        if max_d < 1:
            raise ValueError(f"CountTask: num_terms={self.num_terms} terms counting by 1 do not fit in "
                             f"term_digits={self.term_digits} digits (at most {span + 1} terms)")
        return max_d

    def _starts(self, d: int) -> int:
        """How many starts a step ``d`` allows: ``0 .. 10**term_digits - 1 - (num_terms - 1) * d``."""
        return 10**self.term_digits - (self.num_terms - 1) * d

    def _draw(self, rng: random.Random, n: int) -> list[tuple[int, int]]:
        """``n`` (start, step) pairs: step uniform over the steps that fit, then start uniform; distinct while the
        space of pairs lasts. Why two paths: rejection sampling is cheap in a large space but crawls near
        exhaustion, so a small space is enumerated and shuffled instead (reshuffled for each pass when
        ``n`` exceeds it)."""
        max_d = self._max_step()
        total = sum(self._starts(d) for d in range(1, max_d + 1))
        if 2 * n >= total:
            space = [(s, d) for d in range(1, max_d + 1) for s in range(self._starts(d))]
            out: list[tuple[int, int]] = []
            while len(out) < n:
                rng.shuffle(space)
                out.extend(space[: n - len(out)])
            return out
        seen: set[tuple[int, int]] = set()
        out = []
        while len(out) < n:
            d = rng.randint(1, max_d)
            pair = (rng.randrange(self._starts(d)), d)
            if pair not in seen:
                seen.add(pair)
                out.append(pair)
        return out

    def __len__(self) -> int:
        return len(self._pairs)

    def prompt(self, index: int) -> Prompt:
        s, d = self._pairs[index]
        w = self.term_digits
        end = s + (self.num_terms - 1) * d
        text = f"count {s:0{w}d} by {d} to {end:0{w}d}:"
        answer = " ".join(f"{s + k * d:0{w}d}" for k in range(self.num_terms))
        return Prompt(text, tuple(self.tokenizer.encode(text)), answer)

    def reward(self, prompt: Prompt, response: str) -> tuple[float, bool]:
        return count_reward(response, prompt.answer)

    @property
    def max_response_tokens(self) -> int:
        return self.num_terms * (self.term_digits + 1)
