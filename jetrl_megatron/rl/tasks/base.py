"""What every task shares: the character tokenizer, a prompt, the `Task` protocol, and the synthetic tasks' base.

Why apart: the task modules and the registry (``rl/tasks/__init__.py``) import these, and these import none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class CharTokenizer:
    """One token per ASCII character (ids 0..127 = code points); '\\n' is the end-of-sequence token."""

    vocab_size = 128
    eos_token_id = 10  # "\n"
    pad_token_id = 0

    def encode(self, text: str) -> list[int]:
        ids = [ord(c) for c in text]
        bad = [c for c, i in zip(text, ids, strict=True) if i >= self.vocab_size or i == self.pad_token_id]
        if bad:
            raise ValueError(f"CharTokenizer: characters outside ASCII 1..127: {bad[:5]!r}")
        return ids

    def decode(self, ids: list[int]) -> str:
        out = []
        for i in ids:
            if i == self.eos_token_id:
                break
            out.append(chr(i) if 0 < i < self.vocab_size else "\ufffd")
        return "".join(out)


@dataclass(frozen=True)
class Prompt:
    """One problem: its text, token ids, and the reference answer the reward compares against."""

    text: str
    token_ids: tuple[int, ...]
    answer: str


class Task(Protocol):
    name: str
    tokenizer: Any

    def __len__(self) -> int: ...
    def prompt(self, index: int) -> Prompt: ...
    def reward(self, prompt: Prompt, response: str) -> tuple[float, bool]: ...


class SyntheticTask:
    """What the synthetic tasks share: the character tokenizer, and the reference answer followed by
    end-of-sequence as the supervised warm start's target."""

    tokenizer: CharTokenizer

    def sft_target(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt.answer) + [self.tokenizer.eos_token_id]
