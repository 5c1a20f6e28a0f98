"""The counting task: generator invariants over many seeds and sizes, response lengths, and the dense exact reward."""

import random
import re

import pytest

from jetrl_megatron.rl.tasks import CharTokenizer
from jetrl_megatron.rl.tasks.count_task import CountTask, count_reward

PROMPT_RE = re.compile(r"count (\d+) by (\d) to (\d+):")


def _reference_answer(start: int, step: int, end: int, width: int) -> str:
    """The answer written independently of the task: ``range`` with a step, padded by ``str.zfill``."""
    return " ".join(str(v).zfill(width) for v in range(start, end + 1, step))


def _check_task(task: CountTask) -> None:
    n, w = task.num_terms, task.term_digits
    tok = CharTokenizer()
    for i in range(len(task)):
        p = task.prompt(i)
        m = PROMPT_RE.fullmatch(p.text)
        assert m, p.text
        s_txt, d_txt, e_txt = m.groups()
        assert len(s_txt) == w and len(e_txt) == w
        s, d, e = int(s_txt), int(d_txt), int(e_txt)
        assert 1 <= d <= 9 and e == s + (n - 1) * d
        terms = p.answer.split(" ")
        assert len(terms) == n
        assert all(len(t) == w and t.isdigit() for t in terms)
        vals = [int(t) for t in terms]
        assert vals[0] == s and vals[-1] == e and max(vals) < 10**w
        assert all(b - a == d for a, b in zip(vals, vals[1:], strict=False))
        assert p.answer == _reference_answer(s, d, e, w)
        assert list(p.token_ids) == tok.encode(p.text)
        target = task.sft_target(p)
        assert len(target) == task.max_response_tokens == n * (w + 1)
        assert target[-1] == tok.eos_token_id and tok.eos_token_id not in target[:-1]
        assert tok.decode(target) == p.answer
        assert task.reward(p, p.answer) == (1.0, True)


@pytest.mark.parametrize("seed", range(8))
def test_generator_invariants_random_sizes(seed):
    rng = random.Random(1000 + seed)
    w = rng.randint(1, 5)
    n = rng.randint(1, min(60, 10**w))  # always fits: counting by 1 needs n <= 10**w
    task = CountTask(num_terms=n, term_digits=w, num_prompts=rng.randint(1, 80), seed=seed)
    _check_task(task)


@pytest.mark.parametrize("n,w", [(1, 1), (10, 1), (2, 1), (6, 1), (1000, 3), (200, 3), (819, 4)])
def test_generator_invariants_edge_sizes(n, w):
    """Sizes where large steps do not fit (the step shrinks), the space is tiny (prompts repeat), or one term."""
    task = CountTask(num_terms=n, term_digits=w, num_prompts=50, seed=7)
    _check_task(task)
    steps = {int(PROMPT_RE.fullmatch(task.prompt(i).text).group(2)) for i in range(len(task))}
    assert max(steps) <= (9 if n == 1 else (10**w - 1) // (n - 1))


def test_prompts_distinct_while_space_lasts_then_cover_it():
    task = CountTask(num_terms=30, term_digits=4, num_prompts=500, seed=1)
    assert len({task.prompt(i).text for i in range(len(task))}) == 500
    # n=10, w=1: only 0 1 2 ... 9 (step 1) fits, so 3 prompts are the same one.
    tiny = CountTask(num_terms=10, term_digits=1, num_prompts=3, seed=1)
    assert {tiny.prompt(i).text for i in range(3)} == {"count 0 by 1 to 9:"}
    # n=5, w=1, steps 1..2: 6 + 2 pairs; 20 prompts must cover all 8.
    small = CountTask(num_terms=5, term_digits=1, num_prompts=20, seed=2)
    assert len({small.prompt(i).text for i in range(20)}) == 8


def test_steps_spread_over_one_to_nine():
    task = CountTask(num_terms=20, term_digits=4, num_prompts=900, seed=3)
    steps = [int(PROMPT_RE.fullmatch(task.prompt(i).text).group(2)) for i in range(len(task))]
    assert set(steps) == set(range(1, 10))
    assert all(60 <= steps.count(d) <= 140 for d in range(1, 10))  # ~100 each


@pytest.mark.parametrize("target", [256, 4096])
def test_response_lengths_for_target_tokens(target):
    n = CountTask.terms_for_response_tokens(target)
    task = CountTask(num_terms=n, num_prompts=20, seed=0)
    assert target - 5 < task.max_response_tokens <= target  # within one term of 4 digits + separator
    for i in range(len(task)):
        assert target - 5 < len(task.sft_target(task.prompt(i))) <= target
    _check_task(task)
    assert CountTask.terms_for_response_tokens(256, term_digits=3) == 64
    assert CountTask.terms_for_response_tokens(2) == 1


def test_deterministic_by_seed_and_differs_across_seeds():
    def texts(seed):
        t = CountTask(num_terms=50, num_prompts=64, seed=seed)
        return [t.prompt(i).text for i in range(len(t))]

    assert texts(5) == texts(5)
    assert texts(5) != texts(6)
    assert len(CountTask(num_terms=50, num_prompts=64, seed=5)) == 64


def test_impossible_size_names_parameters():
    with pytest.raises(ValueError, match=r"num_terms=11.*term_digits=1"):
        CountTask(num_terms=11, term_digits=1)
    with pytest.raises(ValueError, match=r"num_terms=10001.*term_digits=4"):
        CountTask(num_terms=10001, term_digits=4)
    CountTask(num_terms=10000, term_digits=4, num_prompts=2)  # the largest that fits: 0000 .. 9999 by 1
    with pytest.raises(ValueError, match="num_terms=0"):
        CountTask(num_terms=0)


ANS = "0010 0013 0016 0019 0022"  # n = 5, written by hand


def test_reward_perfect_and_empty():
    assert count_reward(ANS, ANS) == (1.0, True)
    assert count_reward("", ANS) == (0.0, False)
    assert count_reward("garbage!", ANS) == (0.0, False)


@pytest.mark.parametrize("k", range(5))
def test_reward_truncated_after_k_terms(k):
    resp = " ".join(ANS.split(" ")[:k])
    assert count_reward(resp, ANS) == (k / 5, False)


@pytest.mark.parametrize("j", range(5))
def test_reward_one_wrong_digit_in_term_j(j):
    terms = ANS.split(" ")
    terms[j] = terms[j][:3] + str((int(terms[j][3]) + 1) % 10)
    assert count_reward(" ".join(terms), ANS) == (j / 5, False)


@pytest.mark.parametrize("extra", [1, 3])
def test_reward_extra_trailing_terms(extra):
    resp = ANS + "".join(f" {25 + 3 * i:04d}" for i in range(extra))
    assert count_reward(resp, ANS) == (5 / (5 + extra), False)
    assert count_reward(ANS + " ", ANS) == (5 / 6, False)  # a trailing space is one more (empty) field
    assert count_reward(ANS + "x", ANS) == (4 / 5, False)  # junk glued to the last term spoils that term


def test_reward_double_space_ends_prefix():
    assert count_reward("0010 0013  0016 0019 0022", ANS) == (2 / 6, False)  # the empty field also counts
    assert count_reward(" 0010 0013 0016 0019 0022", ANS) == (0.0, False)
    assert count_reward("0010 0013 0016 0019 0022".replace(" ", "\t"), ANS) == (0.0, False)


def test_task_reward_uses_prompt_answer():
    task = CountTask(num_terms=5, num_prompts=4, seed=0)
    p = task.prompt(0)
    first_two = " ".join(p.answer.split(" ")[:2])
    assert task.reward(p, first_two) == (2 / 5, False)
    assert task.reward(p, p.answer + " 9999") == (5 / 6, False)
