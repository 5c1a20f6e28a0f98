"""Tasks, tokenizer, prompt stream determinism and rewards (including math-verify on our math sample)."""

from pathlib import Path

import pytest

from jetrl_megatron.rl.rewards import addition_reward, math_reward, sort_reward
from jetrl_megatron.rl.tasks import AdditionTask, CharTokenizer, MathTask, PromptStream, SortTask

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


def test_math_task_from_sample_jsonl():
    t = MathTask(SAMPLE, CharTokenizer())
    assert len(t) == 24
    gsm = [t.prompt(i) for i in range(len(t)) if "pencils" in t.prompt(i).text][0]
    assert gsm.answer == "26" and "\\boxed" in gsm.text
    assert t.reward(gsm, "36 - 10 = \\boxed{26}") == (1.0, True)
    with pytest.raises(FileNotFoundError, match="data_path"):
        MathTask("nope.jsonl", CharTokenizer())
