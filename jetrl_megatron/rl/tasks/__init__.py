"""Prompt sources: a synthetic task a tiny model learns on CPU, and math problems (a local JSONL, NeMo-RL's datasets).

Why a synthetic task: the embedded default must show reward rising within minutes on two CPU cores, with a model of
vocabulary 128. Multi-digit addition (or sorting) written one character per token fits that: the reward is exact and
cheap, a short supervised warm-start on the reference answers makes the first rewards non-zero, and GRPO then has
signal to work with.

Every source is a deterministic stream: ``PromptStream`` walks a seeded permutation of the prompt pool and its
position (epoch, index) is saved in checkpoints, so a resumed run sees exactly the prompts it would have seen.

Here: the registry, `build_task` (which task a config names). The types: ``base.py`` (tokenizer, prompt, protocol),
``synthetic.py`` and ``count_task.py`` (synthetic tasks), ``math_task.py`` and ``named_datasets.py`` (math problems),
``rewards.py``, ``stream.py`` (prompt order and the validation split).
"""

from __future__ import annotations

from pathlib import Path

from jetrl_megatron.errors import UserError
from jetrl_megatron.rl.tasks.base import CharTokenizer, Prompt, SyntheticTask, Task
from jetrl_megatron.rl.tasks.count_task import CountTask
from jetrl_megatron.rl.tasks.math_task import DEFAULT_MATH_TEMPLATE, MathTask, load_tokenizer
from jetrl_megatron.rl.tasks.named_datasets import NAMED_MATH_DATASETS, load_named_rows
from jetrl_megatron.rl.tasks.stream import PromptStream, heldout_split
from jetrl_megatron.rl.tasks.synthetic import AdditionTask, SortTask

__all__ = ["DEFAULT_MATH_TEMPLATE", "AdditionTask", "CharTokenizer", "CountTask", "MathTask", "Prompt", "PromptStream",
           "SortTask", "SyntheticTask", "Task", "build_task", "heldout_split", "load_tokenizer"]


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
    d = cfg.data.train
    if d.dataset_name == "synthetic_addition":
        return AdditionTask(d.num_digits, d.num_prompts, seed=d.seed)
    if d.dataset_name == "synthetic_sort":
        return SortTask(d.num_items, d.num_prompts, seed=d.seed)
    if d.dataset_name == "synthetic_count":
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
