"""Prompt sources: a synthetic task a tiny model learns on CPU, and math problems (a local JSONL, NeMo-RL's datasets).

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
    """Math problems and their reference answers, prompted as NeMo-RL's ``math_hf_data_processor`` prompts them: the
    problem formatted by ``data.default.prompt_file`` (a template with ``{}``), after a system message when
    ``data.default.system_prompt_file`` is set, in the tokenizer's chat template with the generation prompt
    (``policy.tokenizer.chat_template_kwargs`` passed to it); a tokenizer without a chat template (the character
    tokenizer) gets the formatted problem as is. Rewards from ``math-verify``.

    Built from a local JSONL (NeMo-RL's ``ResponseDataset``: the problem under ``input_key``, the answer under
    ``output_key``) or, with :meth:`from_rows`, from one of NeMo-RL's named datasets (``rl/named_datasets.py``)."""

    name = "math_jsonl"

    def __init__(self, path: str | Path, tokenizer: Any, prompt_template: str | None = None,
                 max_input_tokens: int | None = None, input_key: str = "input", output_key: str = "output",
                 system_prompt: str | None = None, chat_template_kwargs: dict[str, Any] | None = None):
        import datasets

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"data.train.data_path {path} does not exist (a GSM8K/MATH-style JSONL file)")
        ds = datasets.load_dataset("json", data_files=str(path), split="train")
        rows: list[tuple[str, str]] = []
        for i, row in enumerate(ds):
            problem, gold = row.get(input_key), _gold_answer(row.get(output_key) or "")
            if not problem:
                raise ValueError(f"{path}: row {i} has no '{input_key}' (data.train.input_key); keys: {sorted(row)}")
            if not gold:
                raise ValueError(f"{path}: row {i} has no '{output_key}' (data.train.output_key); keys: {sorted(row)}")
            rows.append((str(problem), gold))
        self._setup(rows, tokenizer, prompt_template, max_input_tokens, system_prompt, chat_template_kwargs)

    @classmethod
    def from_rows(cls, name: str, rows: list[tuple[str, str]], tokenizer: Any, prompt_template: str | None = None,
                  max_input_tokens: int | None = None, system_prompt: str | None = None,
                  chat_template_kwargs: dict[str, Any] | None = None) -> MathTask:
        """A task over (problem, answer) rows already read (a named dataset); a row without an answer is an error."""
        bad = next((i for i, (problem, gold) in enumerate(rows) if not problem or not gold), None)
        if bad is not None:
            raise UserError(f"data.train.dataset_name: {name} row {bad} has an empty problem or answer: {rows[bad]!r}")
        task = cls.__new__(cls)
        task.name = name
        task._setup(rows, tokenizer, prompt_template, max_input_tokens, system_prompt, chat_template_kwargs)
        return task

    def _setup(self, rows: list[tuple[str, str]], tokenizer: Any, prompt_template: str | None,
               max_input_tokens: int | None, system_prompt: str | None,
               chat_template_kwargs: dict[str, Any] | None) -> None:
        self._rows = rows
        self.tokenizer = tokenizer
        self.template = prompt_template or DEFAULT_MATH_TEMPLATE
        self.max_input_tokens = max_input_tokens
        self.system_prompt = system_prompt
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        if system_prompt and not self.chat:
            raise UserError("data.default.system_prompt_file: the tokenizer has no chat template to hold a system "
                            "message (NeMo-RL places it there); set it to null")

    def __len__(self) -> int:
        return len(self._rows)

    def prompt_text(self, index: int) -> str:
        return self.template.format(self._rows[index][0])

    def prompt(self, index: int) -> Prompt:
        text, gold = self.prompt_text(index), self._rows[index][1]
        if self.chat:
            messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            messages.append({"role": "user", "content": text})
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **self.chat_template_kwargs)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template wrote the specials
        else:
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


def _read_prompt_file(key: str, path: str | None) -> str | None:
    """A prompt file's text; a relative path is read from the working directory, as NeMo-RL reads it."""
    if not path:
        return None
    if not Path(path).is_file():
        raise UserError(f"{key}: {path} is not a file (a relative path is read from the working directory "
                        f"{Path.cwd()}, as NeMo-RL reads it: run from there or give an absolute path)")
    return Path(path).read_text()


def build_task(cfg, validation: bool = False) -> Task:
    """The task of ``data.train`` (a RunConfig), or of ``data.validation`` when asked and set."""
    from jetrl_megatron.rl.named_datasets import NAMED_MATH_DATASETS, load_named_rows

    d = cfg.data.train
    if d.dataset_name == "synthetic_addition":
        return AdditionTask(d.num_digits, d.num_prompts, seed=d.seed)
    if d.dataset_name == "synthetic_sort":
        return SortTask(d.num_items, d.num_prompts, seed=d.seed)
    if d.dataset_name == "synthetic_count":
        from jetrl_megatron.rl.count_task import CountTask

        return CountTask(d.num_terms, d.term_digits, d.num_prompts, seed=d.seed)
    use_val = validation and cfg.data.validation is not None
    src, section = (cfg.data.validation, "data.validation") if use_val else (d, "data.train")
    if src.dataset_name in ("ResponseDataset", *NAMED_MATH_DATASETS):
        prompting = dict(prompt_template=_read_prompt_file("data.default.prompt_file", cfg.data.default.prompt_file),
                         max_input_tokens=cfg.data.max_input_seq_length,
                         system_prompt=_read_prompt_file("data.default.system_prompt_file",
                                                         cfg.data.default.system_prompt_file),
                         chat_template_kwargs=cfg.policy.tokenizer.chat_template_kwargs)
        if src.dataset_name == "ResponseDataset":
            return MathTask(src.data_path, load_tokenizer(cfg), input_key=src.input_key, output_key=src.output_key,
                            **prompting)
        output_key = None if f"{section}.output_key" in cfg.defaulted else src.output_key
        rows = load_named_rows(src.dataset_name, cfg.hub, data_path=src.data_path, split=src.split,
                               output_key=output_key, key=section)
        return MathTask.from_rows(src.dataset_name, rows, load_tokenizer(cfg), **prompting)
    raise UserError(f"{section}.dataset_name: {src.dataset_name!r} is not a dataset this project reads: NeMo-RL's "
                    f"math datasets ({', '.join(NAMED_MATH_DATASETS)}) and ResponseDataset (a local JSONL) are; "
                    f"{src.dataset_name} is not a math-answer dataset. Or use synthetic_addition | synthetic_sort | "
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
    """The HF tokenizer of ``policy.tokenizer.name`` (or ``policy.model_name``): a local folder, or a hub id read from
    the Hugging Face cache (``cfg.hub``); the char tokenizer for presets. As NeMo-RL, a tokenizer without a pad token
    pads with its end-of-sequence token."""
    from jetrl_megatron.model.hub import TOKENIZER_FILES, is_hub_id, snapshot

    key = "policy.tokenizer.name" if cfg.policy.tokenizer.name else "policy.model_name"
    name = cfg.policy.tokenizer.name or cfg.policy.model_name
    if name == cfg.model_preset and not Path(name).exists():
        return CharTokenizer()
    if is_hub_id(name):
        name = str(snapshot(name, cfg.hub, key=key, need=TOKENIZER_FILES))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
