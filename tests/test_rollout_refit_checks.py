"""Refit checks that need no engine: validation messages, the BF16 arm's quantization, checksums, spec reading."""

from __future__ import annotations

import pytest
import torch

from jetrl_megatron.fp8.quant import quantize_128x128
from jetrl_megatron.model.shapes import get_model_shape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.rollout.model_dir import (
    checkpoint_spec_for,
    fp8_weight_names,
    hf_config_for,
    quantize_state_dict,
    random_hf_state_dict,
    write_model_dir,
    write_tiny_model_dir,
)
from jetrl_megatron.rollout.refit import (
    RefitError,
    TensorSpec,
    bf16_incoming_spec,
    byte_checksum,
    expected_engine_checksums,
    quantize_bf16_weights,
    read_checkpoint_spec,
    validate_refit,
)

SHAPE = get_model_shape("tiny")


@pytest.fixture(scope="module")
def canonical():
    return quantize_state_dict(random_hf_state_dict(SHAPE, seed=4), SHAPE, Fp8Recipe(bf16_last_layers=1))


def test_checkpoint_spec_matches_what_was_written(tmp_path, canonical):
    rec = Fp8Recipe(bf16_last_layers=1)
    d = write_tiny_model_dir(tmp_path, seed=4, recipe=rec)
    spec = read_checkpoint_spec(d)
    assert spec == {k: TensorSpec(v.dtype, tuple(v.shape)) for k, v in canonical.items()}
    assert spec["model.layers.3.mlp.down_proj.weight"].dtype == torch.bfloat16  # BF16 last layer
    assert "model.layers.3.mlp.down_proj.weight_scale_inv" not in spec
    assert spec["model.layers.0.self_attn.q_proj.weight_scale_inv"] == TensorSpec(torch.float32, (4, 2))
    validate_refit(canonical, spec)  # a complete, well-formed refit passes


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("recipe", [None, Fp8Recipe(), Fp8Recipe(bf16_first_layers=1, bf16_last_layers=1)])
def test_the_spec_known_from_the_shape_is_the_one_a_written_directory_holds(tmp_path, family, tied, recipe):
    """What an engine started without weights (load_format dummy) accepts from its first refit: every name, dtype and
    shape of the directory that would have been written, for every family (qk-norm, QKV bias, tied embeddings), BF16
    and FP8 with BF16 layers, and FFN / vocab sizes that leave partial 128x128 scale blocks."""
    import dataclasses

    from megatron_helpers import tiny_shape

    shape = dataclasses.replace(tiny_shape(family), tie_word_embeddings=tied, ffn_hidden_size=320, vocab_size=200)
    sd = random_hf_state_dict(shape, seed=2)
    if recipe is not None:
        sd = quantize_state_dict(sd, shape, recipe)
    d = write_model_dir(tmp_path, hf_config_for(shape, recipe), sd)
    assert checkpoint_spec_for(shape, recipe) == read_checkpoint_spec(d)


def test_validation_lists_every_problem(canonical):
    spec = {k: TensorSpec(v.dtype, tuple(v.shape)) for k, v in canonical.items()}
    bad = dict(canonical)
    del bad["model.layers.1.mlp.up_proj.weight"], bad["model.layers.1.mlp.up_proj.weight_scale_inv"]
    bad["model.norm.weight"] = canonical["model.norm.weight"].float()
    bad["lm_head.weight"] = canonical["lm_head.weight"][:64]
    bad["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.full((2, 4), float("inf"))
    bad["extra.weight"] = torch.zeros(1)
    with pytest.raises(RefitError) as err:
        validate_refit(bad, spec)
    msg = str(err.value)
    for part in ("incomplete fused group model.layers.1.mlp.gate_up_proj.weight: got only ['gate_proj']",
                 "2 missing tensor(s)", "unexpected tensor name(s): extra.weight",
                 "model.norm.weight: dtype torch.float32 != expected torch.bfloat16",
                 "lm_head.weight: shape (64, 256) != expected (128, 256)",
                 "o_proj.weight_scale_inv: contains NaN/Inf"):
        assert part in msg, msg
    nan_fp8 = dict(canonical)
    w = canonical["model.layers.0.mlp.down_proj.weight"].clone()
    w.view(torch.uint8)[0, 0] = 0x7F  # the E4M3 NaN code
    nan_fp8["model.layers.0.mlp.down_proj.weight"] = w
    with pytest.raises(RefitError, match="down_proj.weight: contains NaN/Inf"):
        validate_refit(nan_fp8, spec)


def test_bf16_arm_quantizes_with_the_trainers_quantizer(canonical):
    rec = Fp8Recipe(mode="bf16_train_fp8_rollout", bf16_last_layers=1)
    bf16 = random_hf_state_dict(SHAPE, seed=4)
    spec = {k: TensorSpec(v.dtype, tuple(v.shape)) for k, v in canonical.items()}
    incoming = bf16_incoming_spec(spec)
    assert incoming == {k: TensorSpec(v.dtype, tuple(v.shape)) for k, v in bf16.items()}
    validate_refit(bf16, incoming)
    names = [n for n, s in spec.items() if s.dtype == torch.float8_e4m3fn]
    assert sorted(names) == sorted(fp8_weight_names(SHAPE, rec))
    out = quantize_bf16_weights(bf16, names, rec)
    q, s = quantize_128x128(bf16["model.layers.2.mlp.gate_proj.weight"], rec)
    assert torch.equal(out["model.layers.2.mlp.gate_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(out["model.layers.2.mlp.gate_proj.weight_scale_inv"], s)
    validate_refit(out, spec)


def test_checksum_is_position_sensitive_and_composes_over_fused_parts(canonical):
    w = canonical["model.layers.0.mlp.down_proj.weight"]
    swapped = w.clone()
    swapped[[0, 1]] = w[[1, 0]]
    assert not torch.equal(swapped.view(torch.uint8), w.view(torch.uint8))
    assert byte_checksum(swapped) != byte_checksum(w)
    assert byte_checksum(w, chunk=1000) == byte_checksum(w)
    sums, shapes = expected_engine_checksums(canonical)
    p = "model.layers.2.self_attn."
    fused = torch.cat([canonical[p + f"{x}_proj.weight"] for x in "qkv"])
    fused_s = torch.cat([canonical[p + f"{x}_proj.weight_scale_inv"] for x in "qkv"])
    assert sums[p + "qkv_proj.weight"] == byte_checksum(fused) and shapes[p + "qkv_proj.weight"] == (1024, 256)
    assert sums[p + "qkv_proj.weight_scale_inv"] == byte_checksum(fused_s)
    assert "model.layers.2.self_attn.q_proj.weight" not in sums
