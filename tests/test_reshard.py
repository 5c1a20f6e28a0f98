"""Resharder with real FP8 tensors: round trips, dequant equality, KV replication, tied embeddings, vocab padding,
all-zero blocks, raw-byte preservation, HF export and refusals (nothing written)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from jetrl_megatron.fp8.quant import dequantize_128x128, quantize_128x128
from jetrl_megatron.model import layout
from jetrl_megatron.model.shapes import PRESETS, ModelShape
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.reshard import (
    MegatronShards,
    ReshardError,
    export_hf_fp8,
    iter_canonical,
    iter_vllm_rank,
    megatron_from_canonical,
)
from jetrl_megatron.reshard_cli import export_main, reshard_check_main

# 2 KV heads: vLLM TP 4 replicates each KV head on 2 ranks; Megatron TP 4 splits mid-group. Vocab 300 needs padding.
SMALL = ModelShape(name="small", family="qwen3", hidden_size=256, num_layers=4, num_attention_heads=4,
                   num_kv_heads=2, head_dim=128, ffn_hidden_size=512, vocab_size=300, rms_norm_eps=1e-6,
                   rope_theta=1e4, rope_scaling=None, tie_word_embeddings=False, qk_norm=True, qkv_bias=False,
                   max_position_embeddings=64)
SMALL_Q2 = ModelShape(name="small-qwen2", family="qwen2", hidden_size=512, num_layers=2, num_attention_heads=4,
                      num_kv_heads=2, head_dim=128, ffn_hidden_size=512, vocab_size=200, rms_norm_eps=1e-6,
                      rope_theta=1e4, rope_scaling=None, tie_word_embeddings=True, qk_norm=False, qkv_bias=True,
                      max_position_embeddings=64)


def _hf_master(shape, seed=0, recipe=None):
    """Random BF16 HF weights; FP8 projections quantized 128x128 (globally, by the reference quantizer)."""
    g = torch.Generator().manual_seed(seed)
    h, f = shape.hidden_size, shape.ffn_hidden_size
    sizes = {"q_proj": (shape.q_size, h), "k_proj": (shape.kv_size, h), "v_proj": (shape.kv_size, h),
             "o_proj": (h, shape.q_size), "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}
    recipe = recipe or Fp8Recipe()
    master, canon = {}, {}
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        for proj, shp in sizes.items():
            name = p + ("mlp." if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn.") + proj + ".weight"
            w = (torch.randn(shp, generator=g) * 0.05).to(torch.bfloat16)
            if proj == "down_proj":
                w[:128, :128] = 0  # an all-zero block
            master[name] = w
            if recipe.module_is_fp8(name, None, shape.num_layers):
                canon[name], canon[name + "_scale_inv"] = quantize_128x128(w, recipe)
            else:
                canon[name] = w
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            canon[p + n] = torch.randn(h, generator=g).to(torch.bfloat16)
        if shape.qk_norm:
            canon[p + "self_attn.q_norm.weight"] = torch.randn(shape.head_dim, generator=g).to(torch.bfloat16)
            canon[p + "self_attn.k_norm.weight"] = torch.randn(shape.head_dim, generator=g).to(torch.bfloat16)
        if shape.qkv_bias:
            for x, n in (("q", shape.q_size), ("k", shape.kv_size), ("v", shape.kv_size)):
                canon[p + f"self_attn.{x}_proj.bias"] = torch.randn(n, generator=g).to(torch.bfloat16)
    canon["model.embed_tokens.weight"] = torch.randn(shape.vocab_size, h, generator=g).to(torch.bfloat16)
    canon["model.norm.weight"] = torch.randn(h, generator=g).to(torch.bfloat16)
    if not shape.tie_word_embeddings:
        canon["lm_head.weight"] = torch.randn(shape.vocab_size, h, generator=g).to(torch.bfloat16)
    return master, canon


def _megatron_trainer_shards(shape, master, canon, tp, pp=1, vp=None, recipe=None):
    """Megatron shards as the trainer holds them: each rank quantizes ITS OWN BF16 shard (Fp8WeightCache style)."""
    recipe = recipe or Fp8Recipe()
    bf16 = dict(canon)
    bf16.update(master)
    for k in [k for k in bf16 if k.endswith("_scale_inv")]:
        del bf16[k]
    src = megatron_from_canonical(bf16, shape, tp, pp, vp)
    for key, state in src.states.items():
        for name in list(state):
            local, rest = layout.split_megatron_layer_name(name)
            if local is None or not rest.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
                                                   "linear_fc2.weight")):
                continue
            g = layout.pp_layer_range(shape.num_layers, pp, key[0], vp, key[1]).start + local
            if recipe.layer_is_fp8(g, shape.num_layers):
                state[name], state[name + "_scale_inv"] = quantize_128x128(state[name], recipe)
    return src


def _same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("shape,tp,pp,vp", [(SMALL, 1, 1, None), (SMALL, 2, 2, None), (SMALL, 4, 1, None),
                                            (SMALL, 2, 2, 2), (SMALL_Q2, 2, 2, None)])
def test_trainer_shards_to_canonical_equals_global_quantization(shape, tp, pp, vp):
    """Per-rank quantization + reshard == quantizing the HF tensor globally: identical bytes and scales."""
    master, canon = _hf_master(shape, seed=tp * 10 + pp)
    src = _megatron_trainer_shards(shape, master, canon, tp, pp, vp)
    got = dict(iter_canonical(src))
    assert set(got) == set(canon)
    for name, t in canon.items():
        assert _same_bytes(got[name], t), name
    if shape.tie_word_embeddings:
        assert "lm_head.weight" not in got


def test_dequant_canonical_equals_dequant_of_concatenated_shards():
    shape, tp = SMALL, 2
    master, canon = _hf_master(shape, seed=3)
    src = _megatron_trainer_shards(shape, master, canon, tp)
    got = dict(iter_canonical(src))
    for layer in range(shape.num_layers):
        p = f"decoder.layers.{layer}."
        deq = {m: [dequantize_128x128(src.states[(0, 0, r)][p + m + ".weight"],
                                      src.states[(0, 0, r)][p + m + ".weight_scale_inv"]) for r in range(tp)]
               for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")}
        q, k, v = layout.qkv_deinterleave(torch.cat(deq["self_attention.linear_qkv"]), 4, 2)
        gate, up = layout.fc1_unshard(deq["mlp.linear_fc1"])
        ref = {"self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v,
               "self_attn.o_proj": torch.cat(deq["self_attention.linear_proj"], 1), "mlp.gate_proj": gate,
               "mlp.up_proj": up, "mlp.down_proj": torch.cat(deq["mlp.linear_fc2"], 1)}
        for proj, r in ref.items():
            n = f"model.layers.{layer}.{proj}.weight"
            d = dequantize_128x128(got[n], got[n + "_scale_inv"])
            assert torch.equal(d, r), n
            assert (d - master[n].float()).abs().max() <= master[n].float().abs().max() / 8  # sane FP8 values
    zero = got["model.layers.0.mlp.down_proj.weight"][:128, :128]
    assert not zero.float().any()


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 1)])
def test_round_trip_megatron_canonical_megatron_bit_exact(tp, pp):
    master, canon = _hf_master(SMALL, seed=5)
    src = _megatron_trainer_shards(SMALL, master, canon, tp, pp)
    # poison every FP8 weight's first byte with a NaN pattern and a negative zero: byte moves must keep them
    for state in src.states.values():
        for t in state.values():
            if t.dtype == torch.float8_e4m3fn:
                t.view(torch.uint8)[0, 0] = 0x7F
                t.view(torch.uint8)[0, 1] = 0x80
    back = megatron_from_canonical(dict(iter_canonical(src)), SMALL, tp, pp)
    for key, state in src.states.items():
        assert set(back.states[key]) == set(state), key
        for name, t in state.items():
            b = back.states[key][name]
            if "word_embeddings" in name or "output_layer" in name:
                v = SMALL.vocab_size - key[2] * t.shape[0]  # rows of this rank inside the real vocab
                assert _same_bytes(b[:max(v, 0)], t[:max(v, 0)]) and not b[max(v, 0):].float().any()
            else:
                assert _same_bytes(b, t), (key, name)


def test_vllm_ranks_kv_replication_and_vocab_padding():
    master, canon = _hf_master(SMALL, seed=7)
    src = _megatron_trainer_shards(SMALL, master, canon, 2, 2)
    tp = 4  # > 2 KV heads: ranks 0,1 serve KV head 0; ranks 2,3 serve KV head 1
    ranks = [dict(iter_vllm_rank(src, tp, r)) for r in range(tp)]
    for layer in range(SMALL.num_layers):
        p = f"model.layers.{layer}."
        for r in range(tp):
            qkv = ranks[r][p + "self_attn.qkv_proj.weight"]
            s = ranks[r][p + "self_attn.qkv_proj.weight_scale_inv"]
            assert qkv.shape == (3 * 128, 256) and s.shape == (3, 2)
            kv_head = r // 2
            assert _same_bytes(qkv[:128], canon[p + "self_attn.q_proj.weight"][r * 128:(r + 1) * 128])
            assert _same_bytes(qkv[128:256], canon[p + "self_attn.k_proj.weight"][kv_head * 128:(kv_head + 1) * 128])
            assert _same_bytes(qkv[256:], canon[p + "self_attn.v_proj.weight"][kv_head * 128:(kv_head + 1) * 128])
            assert _same_bytes(s[1], canon[p + "self_attn.k_proj.weight_scale_inv"][kv_head])
        kv0, kv1 = (ranks[r][p + "self_attn.qkv_proj.weight"][128:] for r in (0, 1))
        assert _same_bytes(kv0, kv1)  # replicas carry identical KV bytes
        assert _same_bytes(ranks[3][p + "self_attn.q_norm.weight"], canon[p + "self_attn.q_norm.weight"])
    # vocab: padded to 320 (multiple of 64) and split in 4 x 80 rows; rows >= 300 are zero
    emb = torch.cat([ranks[r]["model.embed_tokens.weight"] for r in range(tp)])
    assert emb.shape[0] == 320
    assert _same_bytes(emb[:300], canon["model.embed_tokens.weight"]) and not emb[300:].float().any()
    head = torch.cat([ranks[r]["lm_head.weight"] for r in range(tp)])
    assert _same_bytes(head[:300], canon["lm_head.weight"])


def test_tied_embeddings_and_bias_to_vllm():
    shape = SMALL_Q2
    master, canon = _hf_master(shape, seed=11)
    src = _megatron_trainer_shards(shape, master, canon, 2, 2)
    # Megatron keeps a duplicate of the tied embedding on the last stage; it must be ignored
    for t in range(2):
        src.states[(1, 0, t)]["output_layer.weight"] = torch.full((128, 512), 7.0, dtype=torch.bfloat16)
    r0 = dict(iter_vllm_rank(src, 2, 0))
    assert "lm_head.weight" not in r0
    bias = r0["model.layers.1.self_attn.qkv_proj.bias"]
    c = canon
    want = torch.cat([c["model.layers.1.self_attn.q_proj.bias"][:256], c["model.layers.1.self_attn.k_proj.bias"][:128],
                      c["model.layers.1.self_attn.v_proj.bias"][:128]])
    assert _same_bytes(bias, want)
    assert "lm_head.weight" not in dict(iter_canonical(src))


def test_te_padded_scale_columns_are_trimmed():
    master, canon = _hf_master(SMALL, seed=13)
    src = _megatron_trainer_shards(SMALL, master, canon, 2)
    for state in src.states.values():  # TE pads scale columns to a multiple of 4
        for name in [n for n in state if n.endswith("_scale_inv")]:
            s = state[name]
            pad = -s.shape[1] % 4
            state[name] = torch.cat([s, torch.full((s.shape[0], pad), -1.0)], 1) if pad else s
    got = dict(iter_canonical(src))
    for name, t in canon.items():
        assert _same_bytes(got[name], t), name


def test_bf16_excluded_layers_move_without_scales():
    recipe = Fp8Recipe(bf16_first_layers=1, bf16_last_layers=1)
    master, canon = _hf_master(SMALL, seed=17, recipe=recipe)
    src = _megatron_trainer_shards(SMALL, master, canon, 2, recipe=recipe)
    r1 = dict(iter_vllm_rank(src, 1, 0))
    assert r1["model.layers.0.mlp.gate_up_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.gate_up_proj.weight_scale_inv" not in r1
    assert r1["model.layers.1.mlp.gate_up_proj.weight"].dtype == torch.float8_e4m3fn
    assert _same_bytes(r1["model.layers.3.mlp.down_proj.weight"], canon["model.layers.3.mlp.down_proj.weight"])


def test_export_writes_loadable_checkpoint(tmp_path):
    recipe = Fp8Recipe(bf16_last_layers=1)
    master, canon = _hf_master(SMALL, seed=19, recipe=recipe)
    src = _megatron_trainer_shards(SMALL, master, canon, 2, 2, recipe=recipe)
    out = export_hf_fp8(src, recipe, tmp_path / "ckpt", max_shard_bytes=300_000)
    files = sorted(os.listdir(out))
    assert "config.json" in files and "model.safetensors.index.json" in files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    loaded = {}
    for f in set(index["weight_map"].values()):
        loaded.update(load_file(str(out / f)))
    assert set(loaded) == set(canon)
    for name, t in canon.items():
        assert _same_bytes(loaded[name], t), name
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    assert "model.layers.3.mlp.down_proj" in qc["ignored_layers"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp dirs left
    # transformers reads the config back as the same model
    assert ModelShape.from_hf_config(cfg, name="small") == SMALL
    with pytest.raises(FileExistsError):
        export_hf_fp8(src, recipe, out)


def test_vllm_fp8_config_accepts_export_config(tmp_path):
    fp8 = pytest.importorskip("vllm.model_executor.layers.quantization.fp8")
    cfg = Fp8Recipe(bf16_first_layers=1).hf_quantization_config(4)
    parsed = fp8.Fp8Config.from_config(cfg)
    assert parsed.weight_block_size == [128, 128] and parsed.is_checkpoint_fp8_serialized
    assert "model.layers.0.self_attn.q_proj" in parsed.ignored_layers


def test_export_refuses_recipe_mismatch_and_writes_nothing(tmp_path):
    master, canon = _hf_master(SMALL, seed=23)  # all layers FP8
    src = _megatron_trainer_shards(SMALL, master, canon, 1)
    with pytest.raises(ReshardError, match="model.layers.0.self_attn.q_proj.weight: the recipe keeps this tensor BF16"):
        export_hf_fp8(src, Fp8Recipe(bf16_first_layers=1), tmp_path / "x")
    del src.states[(0, 0, 0)]["decoder.layers.2.mlp.linear_fc2.weight_scale_inv"]
    with pytest.raises(ValueError, match="linear_fc2.weight is FP8 but has no"):
        export_hf_fp8(src, Fp8Recipe(), tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


def test_invalid_layouts_refused_before_any_move(tmp_path):
    master, canon = _hf_master(SMALL, seed=29)
    src = _megatron_trainer_shards(SMALL, master, canon, 1)
    with pytest.raises(ReshardError, match="intermediate 512 / vLLM TP 8 = 64 rows per rank"):
        next(iter_vllm_rank(src, 8, 0))
    with pytest.raises(ValueError, match="missing"):
        MegatronShards(SMALL, 2, 1, None, {(0, 0, 0): {}})


def test_cli_reshard_check(capsys):
    assert reshard_check_main(["--model", "qwen3-32b", "--train-tp", "2", "--train-pp", "2", "--rollout-tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "bytes moved per rollout rank" in out and "(0, 0): 0-31, (1, 0): 32-63" in out
    assert reshard_check_main(["--model", "qwen3-4b", "--train-tp", "8", "--rollout-tp", "8"]) == 1
    out = capsys.readouterr().out
    assert "intermediate 9728 / vLLM TP 8 = 1216 rows per rank is not a multiple of 128 (9.5 blocks)" in out
    assert reshard_check_main(["--model", "qwen2.5-7b", "--train-tp", "4", "--rollout-tp", "8"]) == 1
    assert "28 attention heads are not divisible by vLLM TP 8" in capsys.readouterr().out
    assert reshard_check_main(["--model", "nope", "--train-tp", "1", "--rollout-tp", "1"]) == 2
    assert "qwen3-8b" in capsys.readouterr().err
    assert reshard_check_main(["--model", "llama3.1-8b", "--train-tp", "2", "--rollout-tp", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    fp8 = plan["bytes_per_rollout_rank"][0]["fp8"]
    assert fp8 == 32 * (4096 * 4096 * 2 + 2 * 1024 * 4096 + 3 * 14336 * 4096) // 8


def test_cli_export_from_megatron_and_refusal(tmp_path, capsys):
    master, canon = _hf_master(SMALL, seed=31)
    src = _megatron_trainer_shards(SMALL, master, canon, 2)
    mdir = tmp_path / "meg"
    mdir.mkdir()
    for (p, _v, t), state in src.states.items():
        torch.save(dict(state), mdir / f"tp{t}_pp{p}.pt")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMALL.to_hf_config()))
    assert export_main(["--from-megatron", str(mdir), "--model", str(cfg), "--out", str(tmp_path / "hf")]) == 0
    loaded = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert _same_bytes(loaded["model.layers.1.self_attn.k_proj.weight_scale_inv"],
                       canon["model.layers.1.self_attn.k_proj.weight_scale_inv"])
    rc = export_main(["--from-megatron", str(mdir), "--model", str(cfg), "--out", str(tmp_path / "bad"),
                      "--rollout-tp", "8"])
    assert rc == 1 and not (tmp_path / "bad").exists()
    assert "vLLM TP 8" in capsys.readouterr().out
    # from a BF16 HF checkpoint: quantized by the reference 128x128 quantizer
    hf = tmp_path / "bf16"
    hf.mkdir()
    from safetensors.torch import save_file
    bf = {k: v for k, v in canon.items() if not k.endswith("_scale_inv") and v.dtype == torch.bfloat16}
    bf.update(master)
    save_file(bf, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps(SMALL.to_hf_config()))
    assert export_main(["--from-hf", str(hf), "--out", str(tmp_path / "q")]) == 0
    q = load_file(str(tmp_path / "q" / "model.safetensors"))
    for name, t in canon.items():
        assert _same_bytes(q[name], t), name


def test_preset_smoke_fp8_qwen3_06b_layer_shapes():
    """A real-size layer of Qwen3-0.6B (TP2 -> TP1): shapes and dtypes only (kept cheap)."""
    shape = PRESETS["qwen3-0.6b"]
    from jetrl_megatron.reshard import vllm_layer_tensors
    from jetrl_megatron.reshard.addressing import proj_shape
    states = {}
    for t in range(2):
        st = {}
        p = "decoder.layers.0."
        for m, (n, k) in (("self_attention.linear_qkv", (shape.qkv_size // 2, 1024)),
                          ("self_attention.linear_proj", (1024, shape.q_size // 2)),
                          ("mlp.linear_fc1", (3072, 1024)), ("mlp.linear_fc2", (1024, 1536))):
            st[p + m + ".weight"] = torch.zeros(n, k, dtype=torch.uint8).view(torch.float8_e4m3fn)
            st[p + m + ".weight_scale_inv"] = torch.ones(n // 128, k // 128)
        for m in ("input_layernorm", "pre_mlp_layernorm", "self_attention.q_layernorm",
                  "self_attention.k_layernorm"):
            st[p + m + ".weight"] = torch.ones(128, dtype=torch.bfloat16)
        states[(0, 0, t)] = st
    src = MegatronShards(ModelShape.from_hf_config(shape.to_hf_config() | {"num_hidden_layers": 1}, "x"), 2, 1,
                         None, states)
    got = vllm_layer_tensors(src, 0, 1, 0)
    assert got["model.layers.0.self_attn.qkv_proj.weight"].shape == (4096, 1024)
    assert got["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (8, 24)
    assert proj_shape(shape, "o") == (1024, 2048)


@pytest.mark.parametrize("rollout_tp", [1, 4])
def test_refit_program_equals_streaming_and_writes_in_place(rollout_tp):
    from jetrl_megatron.reshard import StaleSourceError, VllmRefitProgram
    master, canon = _hf_master(SMALL, seed=37)
    src = _megatron_trainer_shards(SMALL, master, canon, 2, 2)
    for rank in range(rollout_tp):
        want = dict(iter_vllm_rank(src, rollout_tp, rank))
        dst = {k: torch.full_like(v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v, 3).view(v.dtype)
               for k, v in want.items()}
        prog = VllmRefitProgram(src, rollout_tp, rank, dst=dst)
        for batched in (True, False):
            got = prog.run(batched=batched)
            assert set(got) == set(want)
            for k, v in want.items():
                assert got[k] is dst[k] and _same_bytes(v, got[k]), k
    # the trainer replaces a source tensor: the program refuses to copy stale memory
    key = "decoder.layers.0.mlp.linear_fc1.weight"
    src.states[(0, 0, 1)][key] = src.states[(0, 0, 1)][key].clone()  # read by every program built last
    with pytest.raises(StaleSourceError):
        prog.run()


def test_rollout_preflight_agrees_with_vllm_block_validation(monkeypatch):
    """Our rollout-side refusals == vLLM 0.32's own FP8 block-shape validation (+ its head divisibility rule)."""
    fp8_utils = pytest.importorskip("vllm.model_executor.layers.quantization.utils.fp8_utils")
    import types

    import vllm.distributed

    from jetrl_megatron.reshard import check_reshard

    def vllm_refuses(shape, tp):
        layer = types.SimpleNamespace(tp_size=tp)
        monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: tp)
        nh, ng, hd, h, f = (shape.num_attention_heads, shape.num_kv_heads, shape.head_dim, shape.hidden_size,
                            shape.ffn_hidden_size)
        if nh % tp or (tp >= ng and tp % ng) or (tp < ng and ng % tp):  # QKVParallelLinear's divide() asserts
            return True
        kv = max(1, ng // tp)
        checks = [  # (input_size, output_size, input_size_per_partition, output_partition_sizes)
            (h, (nh + 2 * kv * tp) * hd, h, [nh * hd // tp, kv * hd, kv * hd]),   # qkv_proj
            (nh * hd, h, nh * hd // tp, [h]),                                       # o_proj (row)
            (h, 2 * f, h, [f // tp, f // tp]),                                      # gate_up_proj
            (f, h, f // tp, [h]),                                                   # down_proj (row)
        ]
        try:
            for args in checks:
                fp8_utils.validate_fp8_block_shape(layer, *args, [128, 128])
        except ValueError:
            return True
        return False

    for name in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "llama3.1-8b",
                 "qwen2.5-7b", "tiny"):
        shape = PRESETS[name]
        for tp in (1, 2, 4, 8):
            ours = any(v.side == "rollout" for v in check_reshard(shape, 1, 1, tp))
            assert ours == vllm_refuses(shape, tp), (name, tp)


def test_export_states_what_stock_vllm_does_with_its_scales():
    """The E8M0 condition is printed with every export (stock vLLM 0.26 on Hopper rounds FP32 scales to 2^k)."""
    from jetrl_megatron.reshard_cli import stock_vllm_note

    fp32 = stock_vllm_note(Fp8Recipe(), "fp8")
    assert "VLLM_USE_DEEP_GEMM_E8M0=0" in fp32 and "--scale-fmt pow2" in fp32
    assert "unchanged with its defaults" in stock_vllm_note(Fp8Recipe(scale_fmt="pow2"), "fp8")
    assert "jetrl_fp8 plugin" in stock_vllm_note(Fp8Recipe(), "jetrl_fp8")
