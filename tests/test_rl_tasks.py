"""Tasks, tokenizer, prompt stream determinism and rewards (including math-verify on our math sample)."""

from pathlib import Path

import pytest

from jetrl_megatron.rl.tasks import AdditionTask, CharTokenizer, MathTask, PromptStream, SortTask
from jetrl_megatron.rl.tasks.rewards import addition_reward, math_reward, sort_reward

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "math_sample.jsonl"


def test_char_tokenizer_roundtrip_and_eos():
    tok = CharTokenizer()
    ids = tok.encode("12+34=")
    assert ids == [49, 50, 43, 51, 52, 61] and max(ids) < tok.vocab_size
    assert tok.decode(ids + [tok.eos_token_id, 49]) == "12+34="
    with pytest.raises(ValueError, match="outside ASCII"):
        tok.encode("é")


def test_addition_task_and_reward():
    t = AdditionTask(num_digits=2, num_prompts=50, seed=3)
    p = t.prompt(0)
    a, b = p.text[:-1].split("+")
    assert p.answer == str(int(a) + int(b)) and p.text.endswith("=")
    assert t.sft_target(p)[-1] == CharTokenizer.eos_token_id
    assert addition_reward("85", "85") == (1.0, True)
    assert addition_reward("84", "85") == (0.25, False)  # tens digit right: 0.5 * 1/2
    assert addition_reward("185", "85") == (0.5 * 2 / 3, False)
    assert addition_reward("", "85") == (0.0, False)
    assert sort_reward("1234", "1234") == (1.0, True)
    assert sort_reward("1243", "1234") == (0.25, False)
    s = SortTask(num_items=4, num_prompts=10, seed=1).prompt(2)
    assert s.answer == "".join(sorted(s.text[5:-1]))


def test_prompt_stream_resume_is_exact():
    t = AdditionTask(num_prompts=7, seed=0)
    s1 = PromptStream(t, seed=5)
    first = s1.take(10)  # crosses an epoch boundary
    state = s1.state()
    nxt = s1.take(6)
    s2 = PromptStream(t, seed=5)
    s2.load_state(state)
    assert s2.take(6) == nxt
    assert [p.text for p in first[:7]] != [t.prompt(i).text for i in range(7)]  # shuffled
    assert sorted(p.text for p in first[:7]) == sorted(t.prompt(i).text for i in range(7))


def test_math_reward_math_verify():
    assert math_reward("The answer is \\boxed{42}.", "42") == (1.0, True)
    assert math_reward("so we get \\boxed{0.75}", "\\frac{3}{4}") == (1.0, True)
    assert math_reward("\\boxed{41}", "42") == (0.0, False)
    assert math_reward("no idea", "42") == (0.0, False)


def test_math_task_reads_response_dataset_keys(tmp_path):
    """NeMo-RL's ResponseDataset: the problem under data.train.input_key, the reference answer under output_key
    (GSM8K's "#### 26" tail is the gold answer); a row without either key is named with the key to set."""
    import json

    path = tmp_path / "gsm.jsonl"
    rows = [{"question": "Ana has 3 boxes with 12 pencils each. She gives away 10 pencils. How many are left?",
             "solution": "She had 3*12=36 pencils. After giving away 10 she has 36-10=26.\n#### 26"},
            {"question": "What is 17 + 25?", "solution": "42"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = MathTask(path, CharTokenizer(), input_key="question", output_key="solution")
    assert len(t) == 2
    gsm = t.prompt(0)
    assert gsm.answer == "26" and "pencils" in gsm.text and "\\boxed" in gsm.text
    assert t.reward(gsm, "36 - 10 = \\boxed{26}") == (1.0, True)
    with pytest.raises(ValueError, match=r"row 0 has no 'input' \(data\.train\.input_key\)"):
        MathTask(path, CharTokenizer())  # NeMo-RL's default keys: input / output
    with pytest.raises(ValueError, match=r"row 0 has no 'answer' \(data\.train\.output_key\)"):
        MathTask(path, CharTokenizer(), input_key="question", output_key="answer")
    with pytest.raises(FileNotFoundError, match="data.train.data_path"):
        MathTask("nope.jsonl", CharTokenizer())


def test_math_task_from_sample_jsonl():
    """Our math sample, read with the keys the GPU math recipes set (data.train in grpo_math_base.yaml)."""
    from jetrl_megatron.rl.config import load_config

    tr = load_config("grpo_math_base").data.train
    assert Path(tr.data_path) == Path("data") / SAMPLE.name
    t = MathTask(SAMPLE, CharTokenizer(), input_key=tr.input_key, output_key=tr.output_key)
    assert len(t) == 24
    gsm = [t.prompt(i) for i in range(len(t)) if "pencils" in t.prompt(i).text][0]
    assert gsm.answer == "26" and "\\boxed" in gsm.text
    assert t.reward(gsm, "36 - 10 = \\boxed{26}") == (1.0, True)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_heldout_split_is_disjoint_by_text(seed):
    """The validation prompts share no text with any training prompt (the sort pool repeats texts: 3 digits give
    1000 strings for 4096 prompts), are distinct, deterministic per seed, and every pool index lands on one side."""
    from jetrl_megatron.rl.tasks import heldout_split

    task = SortTask(num_items=3, num_prompts=4096, seed=seed)
    val, train = heldout_split(task, 100, seed=seed)
    val_texts = [task.prompt(i).text for i in val]
    train_texts = {task.prompt(i).text for i in train}
    assert len(val) == 100 and len(set(val_texts)) == 100
    assert not set(val_texts) & train_texts
    counts = {}
    for i in range(len(task)):
        counts[task.prompt(i).text] = counts.get(task.prompt(i).text, 0) + 1
    assert len(train) == len(task) - sum(counts[t] for t in val_texts)  # every copy of a held-out text is held out
    assert heldout_split(task, 100, seed=seed) == (val, train)
    assert heldout_split(task, 100, seed=seed + 1)[0] != val


def test_heldout_split_keeps_half_for_training_and_stream_stays_inside():
    from jetrl_megatron.rl.tasks import heldout_split

    task = SortTask(num_items=2, num_prompts=500, seed=0)  # at most 100 distinct texts
    val, train = heldout_split(task, 1000, seed=0)
    distinct = len({task.prompt(i).text for i in range(len(task))})
    assert len(val) == distinct // 2 and train
    stream = PromptStream(task, seed=3, indices=train)
    val_texts = {task.prompt(i).text for i in val}
    assert all(p.text not in val_texts for p in stream.take(3 * len(train)))
    assert heldout_split(task, 0, seed=0) == ([], list(range(len(task))))
    with pytest.raises(ValueError, match="no prompts"):
        PromptStream(task, seed=0, indices=[])
