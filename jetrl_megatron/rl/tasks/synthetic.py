"""The short synthetic tasks a tiny model learns on CPU: multi-digit addition and digit sorting, one character per
token, with exact cheap rewards (``rewards.py``)."""

from __future__ import annotations

import random

from jetrl_megatron.rl.tasks.base import CharTokenizer, Prompt, SyntheticTask
from jetrl_megatron.rl.tasks.rewards import addition_reward, sort_reward


class AdditionTask(SyntheticTask):
    """``"37+48="`` -> ``"85\\n"``: two operands of ``num_digits`` digits each, answer then end-of-sequence."""

    name = "synthetic_addition"

    def __init__(self, num_digits: int = 2, num_prompts: int = 4096, seed: int = 0):
        self.tokenizer = CharTokenizer()
        self.num_digits = num_digits
        hi = 10**num_digits
        rng = random.Random(seed)
        total = hi * hi
        picks = rng.sample(range(total), min(num_prompts, total))
        self._pairs = [(p // hi, p % hi) for p in picks]

    def __len__(self) -> int:
        return len(self._pairs)

    def prompt(self, index: int) -> Prompt:
        a, b = self._pairs[index]
        text = f"{a}+{b}="
        return Prompt(text, tuple(self.tokenizer.encode(text)), str(a + b))

    def reward(self, prompt: Prompt, response: str) -> tuple[float, bool]:
        return addition_reward(response, prompt.answer)

    @property
    def max_response_tokens(self) -> int:
        return self.num_digits + 2  # sum digits (+1 carry) and EOS


class SortTask(SyntheticTask):
    """``"sort 3142="`` -> ``"1234\\n"``: sort ``num_items`` digits ascending."""

    name = "synthetic_sort"

    def __init__(self, num_items: int = 5, num_prompts: int = 4096, seed: int = 0):
        self.tokenizer = CharTokenizer()
        self.num_items = num_items
        rng = random.Random(seed)
        self._items = ["".join(rng.choice("0123456789") for _ in range(num_items)) for _ in range(num_prompts)]

    def __len__(self) -> int:
        return len(self._items)

    def prompt(self, index: int) -> Prompt:
        s = self._items[index]
        text = f"sort {s}="
        return Prompt(text, tuple(self.tokenizer.encode(text)), "".join(sorted(s)))

    def reward(self, prompt: Prompt, response: str) -> tuple[float, bool]:
        return sort_reward(response, prompt.answer)

    @property
    def max_response_tokens(self) -> int:
        return self.num_items + 1
