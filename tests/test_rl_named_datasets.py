"""NeMo-RL's named math datasets read with ``datasets``, with the meaning NeMo-RL v0.7.0's dataset classes and
``math_hf_data_processor`` give them: which columns are the problem and the answer, the split, subsets and repeats,
the prompt template, the system prompt and the chat template. Each dataset is written in the test, in a hub cache or
as a local copy (``data.train.data_path``); the expected prompts and answers are spelled out by hand."""

from __future__ import annotations

import json

import pytest
from hub_cache import offline_hub, snapshot_dir, write_char_tokenizer

from jetrl_megatron.errors import UserError
from jetrl_megatron.rl.config import load_config
from jetrl_megatron.rl.tasks import build_task


@pytest.fixture
def hub(tmp_path, monkeypatch):
    return offline_hub(tmp_path, monkeypatch, datasets_too=True)


def _cfg(*overrides: str):
    return load_config("tiny_cpu", ["data.max_input_seq_length=null", *overrides])


def _rows(task) -> list[tuple[str, str]]:
    return [(task.prompt_text(i), task.prompt(i).answer) for i in range(len(task))]


def test_openmathinstruct2_from_a_save_to_disk_copy(hub, tmp_path):
    """problem -> prompt, expected_answer -> answer, split train_1M by default; output_key picks another column."""
    import datasets

    one = {"problem": ["What is 2+3?", "Solve x+1=4."], "expected_answer": ["5", "3"], "generated_solution": ["a", "b"]}
    other = {"problem": ["unused"], "expected_answer": ["0"], "generated_solution": ["c"]}
    path = tmp_path / "omi2"
    datasets.DatasetDict({"train_1M": datasets.Dataset.from_dict(one),
                          "train": datasets.Dataset.from_dict(other)}).save_to_disk(str(path))
    base = ["data.train.dataset_name=OpenMathInstruct-2", f"data.train.data_path={path}"]
    task = build_task(_cfg(*base))
    assert task.name == "OpenMathInstruct-2"
    assert [(p.split("\n")[0], a) for p, a in _rows(task)] == [("What is 2+3?", "5"), ("Solve x+1=4.", "3")]
    assert _rows(build_task(_cfg(*base, "data.train.split=train")))[0][1] == "0"
    assert [a for _, a in _rows(build_task(_cfg(*base, "data.train.output_key=generated_solution")))] == ["a", "b"]
    with pytest.raises(UserError, match=r"^data\.train\.split: 'test' is not a split of OpenMathInstruct-2"):
        build_task(_cfg(*base, "data.train.split=test"))


def test_dapo_math_nested_columns_from_a_parquet_file(hub, tmp_path):
    import datasets

    rows = {"prompt": [[{"role": "user", "content": "Find 6*7."}]], "reward_model": [{"ground_truth": "42",
                                                                                      "style": "rule"}]}
    path = tmp_path / "dapo.parquet"
    datasets.Dataset.from_dict(rows).to_parquet(str(path))
    task = build_task(_cfg("data.train.dataset_name=DAPOMath17K", f"data.train.data_path={path}",
                           "data.default.prompt_file=null"))
    assert task.prompt_text(0).startswith("Find 6*7.\n") and task.prompt(0).answer == "42"


def test_gsm8k_and_aime2025_from_the_hub_cache(hub):
    """GSM8K: config "main", the number after "####"; AIME2025: configs I and II concatenated, split test, the
    answer as text, the whole set repeated 16 times (NeMo-RL's repeat)."""
    gsm = snapshot_dir(hub, "openai/gsm8k", repo_type="dataset")
    (gsm / "main").mkdir()
    (gsm / "main" / "train.jsonl").write_text(json.dumps({"question": "Ana has 3+4 pens?", "answer": "3+4=7\n#### 7"}))
    (gsm / "main" / "test.jsonl").write_text(json.dumps({"question": "Bob?", "answer": "#### 9"}))
    (gsm / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: "
                                   "main/train.jsonl\n  - split: test\n    path: main/test.jsonl\n---\n")
    task = build_task(_cfg("data.train.dataset_name=GSM8K"))
    assert task.prompt(0).answer == "7" and task.prompt_text(0).startswith("Ana has 3+4 pens?")
    assert build_task(_cfg("data.train.dataset_name=gsm8k", "data.train.split=test")).prompt(0).answer == "9"

    aime = snapshot_dir(hub, "opencompass/AIME2025", repo_type="dataset")
    for part, q, a in (("I", "First?", 1), ("II", "Second?", 22)):
        (aime / f"aime2025-{part}.jsonl").write_text(json.dumps({"question": q, "answer": a}))
    (aime / "README.md").write_text("---\nconfigs:\n- config_name: AIME2025-I\n  data_files:\n  - split: test\n    "
                                    "path: aime2025-I.jsonl\n- config_name: AIME2025-II\n  data_files:\n  - split: "
                                    "test\n    path: aime2025-II.jsonl\n---\n")
    task = build_task(_cfg("data.train.dataset_name=AIME2025", "data.default.prompt_file=null"))
    assert len(task) == 32
    assert [(p.split("\n")[0], a) for p, a in _rows(task)[:2]] == [("First?", "1"), ("Second?", "22")]


def test_a_named_validation_dataset(hub, tmp_path):
    """data.validation names a dataset of its own (NeMo-RL's DAPO recipes validate on DAPOMathAIME2024)."""
    import datasets

    train, val = tmp_path / "deepscaler.jsonl", tmp_path / "aime.parquet"
    train.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "AIME q"}]],
                                "reward_model": [{"ground_truth": "204"}]}).to_parquet(str(val))
    cfg = _cfg("data.train.dataset_name=DeepScaler", f"data.train.data_path={train}",
               "+data.validation.dataset_name=DAPOMathAIME2024", f"+data.validation.data_path={val}")
    assert build_task(cfg).prompt(0).answer == "2"
    v = build_task(cfg, validation=True)
    assert v.name == "DAPOMathAIME2024" and v.prompt(0).answer == "204"


def test_prompt_file_system_prompt_and_chat_template(hub, tmp_path):
    """math_hf_data_processor's prompt: [system] + [user: prompt_file.format(problem)] in the tokenizer's chat
    template with the generation prompt, tokenized without extra special tokens."""
    model = snapshot_dir(hub, "test-org/char")
    write_char_tokenizer(model)
    (tmp_path / "p.txt").write_text("Q: {} A:")
    (tmp_path / "s.txt").write_text("Be exact.")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"problem": "2+2", "answer": "4"}) + "\n")
    cfg = _cfg("policy.model_name=test-org/char", "data.train.dataset_name=DeepScaler", f"data.train.data_path={data}",
               f"data.default.prompt_file={tmp_path / 'p.txt'}",
               f"data.default.system_prompt_file={tmp_path / 's.txt'}")
    p = build_task(cfg).prompt(0)
    want = "[system]Be exact.[user]Q: 2+2 A:[assistant]"
    assert p.text == want and list(p.token_ids) == [ord(c) for c in want] and p.answer == "4"
    # the character tokenizer has no chat template: a system prompt has nowhere to go
    with pytest.raises(UserError, match=r"^data\.default\.system_prompt_file: the tokenizer has no chat template"):
        build_task(_cfg("data.train.dataset_name=DeepScaler", f"data.train.data_path={data}",
                        f"data.default.system_prompt_file={tmp_path / 's.txt'}"))


def test_a_dataset_not_in_any_cache_is_one_line(hub):
    with pytest.raises(UserError) as e:
        build_task(_cfg("data.train.dataset_name=DeepScaler"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("data.train.dataset_name: DeepScaler "
                                              "(agentica-org/DeepScaleR-Preview-Dataset, split 'train')")
    assert str(hub) in msg and "datasets' cache" in msg and "data.train.data_path" in msg
    with pytest.raises(UserError, match=r"^data\.train\.dataset_name: 'squad' is not a dataset this project reads"):
        build_task(_cfg("data.train.dataset_name=squad"))
