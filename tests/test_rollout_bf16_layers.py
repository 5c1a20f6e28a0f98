"""The recipe's BF16 layers stay unquantized in vLLM (fused qkv / gate_up included) and the served model still
matches the reference forward bit for bit (FP8 projections in the middle layers, BF16 in the first and last)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from deadline import deadline  # noqa: E402
from rollout_reference import (  # noqa: E402
    ReferenceModel,
    live_model,  # noqa: E402
    vllm_cpu_attention,
)

from jetrl_megatron.model.shapes import get_model_shape  # noqa: E402
from jetrl_megatron.recipe import Fp8Recipe  # noqa: E402
from jetrl_megatron.rollout.model_dir import load_state_dict, write_tiny_model_dir  # noqa: E402

SHAPE = get_model_shape("tiny")
RECIPE = Fp8Recipe(bf16_first_layers=1, bf16_last_layers=1, scale_fmt="pow2")


def test_bf16_layers_unquantized_and_bit_exact(tmp_path):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine
    from jetrl_megatron.rollout.quant_method import JetRLFp8LinearMethod

    model_dir = write_tiny_model_dir(tmp_path, seed=5, recipe=RECIPE)
    sd = load_state_dict(model_dir)
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert sd["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    with deadline(240, "bf16-layers engine"):
        engine = RolloutEngine(RolloutConfig(model_dir=model_dir, recipe=RECIPE))
        try:
            layers = live_model(engine).model.layers
            for i, layer in enumerate(layers):
                want = UnquantizedLinearMethod if i in (0, 3) else JetRLFp8LinearMethod
                for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                            layer.mlp.down_proj):
                    assert isinstance(mod.quant_method, want), (i, type(mod.quant_method))
            g = torch.Generator().manual_seed(1)
            prompts = torch.randint(0, SHAPE.vocab_size, (3, 10), generator=g).tolist()
            samples = engine.generate(prompts, n=2, max_tokens=16, seed=2)
            scored = engine.score([s.prompt_token_ids + s.token_ids for s in samples])
            isa = layers[0].self_attn.attn.isa
        finally:
            engine.shutdown()
    ref = ReferenceModel(sd, SHAPE, RECIPE, attention=vllm_cpu_attention(isa))
    for s, lp in zip(samples, scored, strict=True):
        full = s.prompt_token_ids + s.token_ids
        assert s.logprobs == ref.token_logprobs(full, start=len(s.prompt_token_ids))
        assert lp == ref.token_logprobs(full)
