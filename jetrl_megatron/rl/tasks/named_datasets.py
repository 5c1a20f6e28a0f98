"""NeMo-RL v0.7.0's named math datasets (``data.train.dataset_name: OpenMathInstruct-2``, ...), read with ``datasets``.

Why a table: each of NeMo-RL's dataset classes (``nemo_rl/data/datasets/response_datasets/*.py``) names a hub dataset,
a split, and which columns become the user's problem and the reference answer; its ``math_hf_data_processor`` then
formats the problem with ``data.default.prompt_file`` and the chat template and keeps the answer as the ground truth
(``rl/tasks/math_task.py``, :class:`MathTask`). :data:`NAMED_MATH_DATASETS` states those choices, so a NeMo-RL recipe's
``dataset_name`` means the same prompts and answers here.

Where the rows come from, first found wins: ``data_path`` (a local copy: a ``save_to_disk`` folder, a
parquet/json/jsonl/csv/arrow file, or a folder with the dataset repository's files), the dataset repository in the
Hugging Face hub cache (``cfg.hub``), then ``datasets.load_dataset(<hub id>)`` (``datasets``' own cache; a download
when online).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jetrl_megatron.errors import UserError, one_line
from jetrl_megatron.model.hub import HubCache, cached_snapshot

if TYPE_CHECKING:
    import datasets

@dataclass(frozen=True)
class NamedMathDataset:
    """One of NeMo-RL's math datasets: where it lives and what its rows mean."""

    hub_id: str
    problem: Callable[[dict[str, Any]], Any]  # the user's problem (formatted by the prompt template)
    answer: Callable[[dict[str, Any]], Any]  # the reference answer math-verify compares against
    split: str = "train"  # NeMo-RL's split (``data.*.split`` picks another where NeMo-RL takes one)
    subsets: tuple[str | None, ...] = (None,)  # dataset configs, concatenated in order
    repeat: int = 1  # NeMo-RL repeats small evaluation sets (AIME: 16 times)
    splits: tuple[str, ...] | None = None  # the splits NeMo-RL accepts (None: the one above only)
    output_key: str | None = None  # the answer column when ``data.*.output_key`` may choose it (its default)


def _column(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda row: row[name]


def _dapo_problem(row: dict[str, Any]) -> Any:
    return row["prompt"][0]["content"]  # a chat list; its first message is the user's problem


def _dapo_answer(row: dict[str, Any]) -> Any:
    return row["reward_model"]["ground_truth"]


def _gsm8k_answer(row: dict[str, Any]) -> Any:
    text = str(row["answer"])
    return text.split("####")[1].strip() if "####" in text else None  # the number after "####", as NeMo-RL


_AIME = dict(answer=_column("answer"), repeat=16)

NAMED_MATH_DATASETS: dict[str, NamedMathDataset] = {
    "OpenMathInstruct-2": NamedMathDataset("nvidia/OpenMathInstruct-2", _column("problem"), _column("expected_answer"),
                                           split="train_1M", splits=("train", "train_1M", "train_2M", "train_5M"),
                                           output_key="expected_answer"),
    "DAPOMath17K": NamedMathDataset("BytedTsinghua-SIA/DAPO-Math-17k", _dapo_problem, _dapo_answer),
    "DAPOMathAIME2024": NamedMathDataset("BytedTsinghua-SIA/AIME-2024", _dapo_problem, _dapo_answer),
    "DeepScaler": NamedMathDataset("agentica-org/DeepScaleR-Preview-Dataset", _column("problem"), _column("answer")),
    "AIME2024": NamedMathDataset("HuggingFaceH4/aime_2024", _column("problem"), **_AIME),
    "AIME2025": NamedMathDataset("opencompass/AIME2025", _column("question"), split="test",
                                 subsets=("AIME2025-I", "AIME2025-II"), **_AIME),
    "AIME2026": NamedMathDataset("MathArena/aime_2026", _column("problem"), **_AIME),
    "GSM8K": NamedMathDataset("openai/gsm8k", _column("question"), _gsm8k_answer, subsets=("main",),
                              splits=("train", "test")),
}
NAMED_MATH_DATASETS["gsm8k"] = NAMED_MATH_DATASETS["GSM8K"]

# Local files by extension, as NeMo-RL's load_dataset_from_path reads them.
_FILE_TYPES = {".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _read_local(path: Path, subset: str | None, split: str, key: str) -> datasets.Dataset:
    import datasets

    if path.is_file():
        kind = _FILE_TYPES.get(path.suffix)
        if kind is None:
            raise UserError(f"{key}: {path} is not one of {sorted(_FILE_TYPES)} (or a folder)")
        return datasets.load_dataset(kind, data_files=str(path), split="train")  # the file is the split
    try:  # a save_to_disk folder (load_dataset would read a DatasetDict's splits as one)
        out = datasets.load_from_disk(str(path))
    except FileNotFoundError:  # datasets' answer for a folder save_to_disk did not write: the repository's files
        return datasets.load_dataset(str(path), subset, split=split)
    if isinstance(out, datasets.DatasetDict):
        if split not in out:
            raise UserError(f"{key}: {path} has splits {sorted(out)}, not {split!r}")
        out = out[split]
    return out


def load_named_rows(name: str, hub: HubCache, *, data_path: str | None, split: str | None,
                    output_key: str | None, key: str) -> list[tuple[str, str]]:
    """(problem, reference answer) of every row of NeMo-RL's dataset ``name``, in the dataset's order (repeated as
    NeMo-RL repeats it). ``key`` is the config section (``data.train``) the error messages name."""
    import datasets
    spec = NAMED_MATH_DATASETS[name]
    split = split or spec.split
    if split not in (spec.splits or (spec.split,)):
        raise UserError(f"{key}.split: {split!r} is not a split of {name} (NeMo-RL accepts "
                        f"{', '.join(spec.splits or (spec.split,))})")
    answer = _column(output_key) if spec.output_key and output_key else spec.answer
    local = Path(data_path).expanduser() if data_path else cached_snapshot(spec.hub_id, hub, repo_type="dataset")
    if data_path and not local.exists():
        raise UserError(f"{key}.data_path: {data_path} does not exist (a local copy of {name}: a save_to_disk folder, "
                        "a parquet/json/jsonl file, or a folder with the repository's files)")
    parts = []
    for subset in spec.subsets:
        try:
            parts.append(_read_local(local, subset, split, f"{key}.data_path") if local is not None
                         else datasets.load_dataset(spec.hub_id, subset, split=split))
        except UserError:
            raise
        except Exception as e:
            where = local or f"{hub.where()} nor in datasets' cache {datasets.config.HF_DATASETS_CACHE}"
            raise UserError(f"{key}.dataset_name: {name} ({spec.hub_id}, split {split!r}) could not be read from "
                            f"{where} ({one_line(e, limit=200)}); download it (`hf download {spec.hub_id} "
                            f"--repo-type dataset`) or set {key}.data_path to a local copy") from None
    rows = []
    for part in parts:
        for i, row in enumerate(part):
            try:
                problem, gold = spec.problem(row), answer(row)
            except (KeyError, IndexError, TypeError) as e:
                raise UserError(f"{key}.dataset_name: {name} row {i} lacks {one_line(e, 80)} (NeMo-RL's columns for "
                                f"{name}); columns: {sorted(row)}") from None
            rows.append((str(problem), "" if gold is None else str(gold).strip()))
    return rows * spec.repeat
