"""Deterministic prompt order: the seeded epoch-wise walk a checkpoint resumes (`PromptStream`), and the held-out
validation split by prompt text."""

from __future__ import annotations

import random

from jetrl_megatron.rl.tasks.base import Prompt, Task


class PromptStream:
    """Deterministic epoch-wise shuffled walk over a task's prompts (or the subset ``indices``);
    ``state()``/``load_state()`` for resume."""

    def __init__(self, task: Task, seed: int, shuffle: bool = True, indices: list[int] | None = None):
        self.task, self.seed, self.shuffle = task, seed, shuffle
        self.indices = list(range(len(task))) if indices is None else list(indices)
        if not self.indices:
            raise ValueError(f"task {task.name}: no prompts to draw from")
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(self.indices)
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
            out.append(self.task.prompt(self._order[self.index]))
            self.index += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)


def heldout_split(task: Task, num_val: int, seed: int) -> tuple[list[int], list[int]]:
    """(validation indices, training indices): ``num_val`` prompts with distinct texts, and every prompt whose text
    is not among them. Split by text, not index, because a synthetic pool repeats texts: an index split would
    validate on prompts the policy was trained on. Capped so at least half of the distinct texts stay for training."""
    order = list(range(len(task)))
    random.Random(seed * 1_000_003 + 7919).shuffle(order)
    text_of = getattr(task, "prompt_text", None) or (lambda i: task.prompt(i).text)
    texts = [text_of(i) for i in range(len(task))]
    distinct = len(set(texts))
    num_val = min(num_val, distinct // 2)
    val: list[int] = []
    val_texts: set[str] = set()
    for i in order:
        if len(val) >= num_val:
            break
        if texts[i] not in val_texts:
            val.append(i)
            val_texts.add(texts[i])
    train = [i for i in range(len(task)) if texts[i] not in val_texts]
    return val, train
