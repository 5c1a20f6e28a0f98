"""Prompt sources: a synthetic task a tiny model learns on CPU, and math problems from a local JSONL file.

Why a synthetic task: the embedded default must show reward rising within minutes on two CPU cores, with a model of
vocabulary 128. Multi-digit addition (or sorting) written one character per token fits that: the reward is exact and
cheap, a short supervised warm-start on the reference answers makes the first rewards non-zero, and GRPO then has
signal to work with.

Every source is a deterministic stream: ``PromptStream`` walks a seeded permutation of the prompt pool and its
position (epoch, index) is saved in checkpoints, so a resumed run sees exactly the prompts it would have seen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from jetrl_megatron.errors import UserError
from jetrl_megatron.rl.rewards import addition_reward, math_reward, sort_reward


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


DEFAULT_MATH_TEMPLATE = "{}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def _gold_answer(ans: Any) -> str:
    ans = str(ans)
    if "####" in ans:  # GSM8K: the final answer follows "####"
        ans = ans.rsplit("####", 1)[1]
    return ans.strip()


class MathTask:
    """GSM8K / MATH-style problems from a local JSONL file, NeMo-RL's ``ResponseDataset``: the problem under
    ``input_key``, the reference answer under ``output_key``; read with ``datasets``; rewards from ``math-verify``."""

    name = "math_jsonl"

    def __init__(self, path: str | Path, tokenizer: Any, prompt_template: str | None = None,
                 max_input_tokens: int | None = None, input_key: str = "input", output_key: str = "output"):
        import datasets

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"data.train.data_path {path} does not exist (a GSM8K/MATH-style JSONL file)")
        ds = datasets.load_dataset("json", data_files=str(path), split="train")
        self.tokenizer = tokenizer
        self.template = prompt_template or DEFAULT_MATH_TEMPLATE
        self._rows: list[tuple[str, str]] = []
        for i, row in enumerate(ds):
            problem, gold = row.get(input_key), _gold_answer(row.get(output_key) or "")
            if not problem:
                raise ValueError(f"{path}: row {i} has no '{input_key}' (data.train.input_key); keys: {sorted(row)}")
            if not gold:
                raise ValueError(f"{path}: row {i} has no '{output_key}' (data.train.output_key); keys: {sorted(row)}")
            self._rows.append((str(problem), gold))
        self.max_input_tokens = max_input_tokens

    def __len__(self) -> int:
        return len(self._rows)

    def prompt_text(self, index: int) -> str:
        return self.template.format(self._rows[index][0])

    def prompt(self, index: int) -> Prompt:
        text, gold = self.prompt_text(index), self._rows[index][1]
        ids = self.tokenizer.encode(text)
        if self.max_input_tokens is not None and len(ids) > self.max_input_tokens:
            ids = ids[-self.max_input_tokens:]
        return Prompt(text, tuple(ids), gold)

    def reward(self, prompt: Prompt, response: str) -> tuple[float, bool]:
        return math_reward(response, prompt.answer)


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


def build_task(cfg, validation: bool = False) -> Task:
    """The task of ``data.train`` (a RunConfig), or of ``data.validation`` when asked and set."""
    d = cfg.data.train
    if d.dataset_name == "synthetic_addition":
        return AdditionTask(d.num_digits, d.num_prompts, seed=d.seed)
    if d.dataset_name == "synthetic_sort":
        return SortTask(d.num_items, d.num_prompts, seed=d.seed)
    if d.dataset_name == "synthetic_count":
        from jetrl_megatron.rl.count_task import CountTask

        return CountTask(d.num_terms, d.term_digits, d.num_prompts, seed=d.seed)
    if d.dataset_name == "ResponseDataset":
        src = cfg.data.validation if validation and cfg.data.validation is not None else d
        prompt_file = cfg.data.default.prompt_file
        template = Path(prompt_file).read_text() if prompt_file else None
        return MathTask(src.data_path, load_tokenizer(cfg), template, cfg.data.max_input_seq_length,
                        input_key=src.input_key, output_key=src.output_key)
    raise UserError(f"data.train.dataset_name: {d.dataset_name!r} is not a dataset this project reads. NeMo-RL "
                    "downloads its named datasets (OpenMathInstruct-2, DAPOMath17K, ...) from the Hugging Face hub; "
                    "here, export one to a local JSONL and set data.train.dataset_name=ResponseDataset "
                    "data.train.data_path=<file.jsonl> data.train.input_key=<problem column> "
                    "data.train.output_key=<answer column>; or use synthetic_addition | synthetic_sort | "
                    "synthetic_count")


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


def load_tokenizer(cfg):
    """The HF tokenizer of ``policy.tokenizer.name`` (or ``policy.model_name``); the char tokenizer for presets."""
    name = cfg.policy.tokenizer.name or cfg.policy.model_name
    if name == cfg.model_preset and not Path(name).exists():
        return CharTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)
