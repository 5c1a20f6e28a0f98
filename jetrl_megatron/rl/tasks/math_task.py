"""Math problems with reference answers, prompted as NeMo-RL prompts them and rewarded by ``math-verify``; the
tokenizer a run reads them with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jetrl_megatron.errors import UserError
from jetrl_megatron.model.hub import TOKENIZER_FILES, is_hub_id, snapshot
from jetrl_megatron.rl.tasks.base import CharTokenizer, Prompt
from jetrl_megatron.rl.tasks.rewards import math_reward

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
    ``output_key``) or, with :meth:`from_rows`, from one of NeMo-RL's named datasets
    (``rl/tasks/named_datasets.py``)."""

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


def load_tokenizer(cfg):
    """The HF tokenizer of ``policy.tokenizer.name`` (or ``policy.model_name``): a local folder, or a hub id read from
    the Hugging Face cache (``cfg.hub``); the char tokenizer for presets. As NeMo-RL, a tokenizer without a pad token
    pads with its end-of-sequence token."""
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
