"""Resharder throughput on one GPU: Qwen3-8B-sized random FP8 weights in a Megatron TP2 layout -> vLLM TP1 and TP4.

All ranks live on the one device (the mover's job is the slab copies; a multi-GPU deployment adds the transport).
Reports bytes written per second (every byte is read once and written once, like a device copy) against the device
copy bandwidth measured in the same run with one large `copy_`. Prints a table; writes JSON to $OUT if set.

    PYTHONPATH=. python3 bench/reshard_bench.py [--layers 36] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from jetrl_megatron.model import layout
from jetrl_megatron.model.shapes import get_model_shape
from jetrl_megatron.reshard import MegatronShards, VllmRefitProgram, canonical_layer_tensors, iter_vllm_rank


def random_megatron_tp(shape, tp: int, device: str, gen: torch.Generator) -> MegatronShards:
    """Random FP8 bytes + FP32 scales with Megatron TP `tp` shapes (BF16 norms / embeddings)."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    gemm = {"self_attention.linear_qkv": (shape.qkv_size // tp, h),
            "self_attention.linear_proj": (h, shape.q_size // tp),
            "mlp.linear_fc1": (2 * f // tp, h), "mlp.linear_fc2": (h, f // tp)}
    vocab_rows = layout.padded_vocab_size(shape.vocab_size, tp) // tp
    states = {}
    for t in range(tp):
        st: dict[str, torch.Tensor] = {}
        for layer in range(shape.num_layers):
            p = f"decoder.layers.{layer}."
            for name, (n, k) in gemm.items():
                st[p + name + ".weight"] = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=device,
                                                         generator=gen).view(torch.float8_e4m3fn)
                st[p + name + ".weight_scale_inv"] = torch.rand((-(-n // 128), -(-k // 128)), device=device,
                                                                generator=gen)
            for name in ("input_layernorm.weight", "pre_mlp_layernorm.weight"):
                st[p + name] = torch.randn(h, device=device, generator=gen).bfloat16()
            for name in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
                st[p + name] = torch.randn(shape.head_dim, device=device, generator=gen).bfloat16()
        st["embedding.word_embeddings.weight"] = torch.randn(vocab_rows, h, device=device, generator=gen).bfloat16()
        st["decoder.final_layernorm.weight"] = torch.randn(h, device=device, generator=gen).bfloat16()
        st["output_layer.weight"] = torch.randn(vocab_rows, h, device=device, generator=gen).bfloat16()
        states[(0, 0, t)] = st
    return MegatronShards(shape, tp, 1, None, states)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int, repeats: int) -> float:
    """Bytes per second of one large device-to-device copy (bytes copied, i.e. one side)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        _sync()
        best = min(best, time.perf_counter() - t0)
    del a, b
    return nbytes / best


def reshard_once(src: MegatronShards, rollout_tp: int, device: str) -> tuple[float, int, int]:
    """Time building every rollout rank's full tensor set (streamed layer by layer). -> (seconds, bytes, tensors)."""
    _sync()
    t0 = time.perf_counter()
    total, count = 0, 0
    for rank in range(rollout_tp):
        for _, t in iter_vllm_rank(src, rollout_tp, rank, device=device):
            total += t.numel() * t.element_size()
            count += 1
            del t  # streamed: the consumer would load it into the engine here
    _sync()
    return time.perf_counter() - t0, total, count


def time_program(progs: list[VllmRefitProgram], repeats: int, **kw) -> list[float]:
    times = []
    for _ in range(repeats + 1):  # first run = warm-up
        _sync()
        t0 = time.perf_counter()
        for p in progs:
            p.run(**kw)
        _sync()
        times.append(time.perf_counter() - t0)
    return times[1:]


def check_layer(src: MegatronShards, device: str) -> None:
    """Spot check on the device: TP4 rank 1's gate_up and qkv rows equal the canonical tensors' slices."""
    canon = canonical_layer_tensors(src, 0)
    got = {k: v for k, v in iter_vllm_rank_layer0(src, 4, 1, device)}
    f4 = src.shape.ffn_hidden_size // 4
    gate = canon["model.layers.0.mlp.gate_proj.weight"].view(torch.uint8)
    up = canon["model.layers.0.mlp.up_proj.weight"].view(torch.uint8)
    want = torch.cat([gate[f4:2 * f4], up[f4:2 * f4]])
    assert torch.equal(got["model.layers.0.mlp.gate_up_proj.weight"].view(torch.uint8), want)
    q = canon["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8)
    k = canon["model.layers.0.self_attn.k_proj.weight"].view(torch.uint8)
    qkv = got["model.layers.0.self_attn.qkv_proj.weight"].view(torch.uint8)
    assert torch.equal(qkv[:1024], q[1024:2048]) and torch.equal(qkv[1024:1280], k[256:512])
    s = canon["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight_scale_inv"], s[:, 24:48])


def iter_vllm_rank_layer0(src, tp, rank, device):
    from jetrl_megatron.reshard import vllm_layer_tensors
    return vllm_layer_tensors(src, 0, tp, rank, device).items()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (default: the model's)")
    ap.add_argument("--train-tp", type=int, default=2)
    ap.add_argument("--rollout-tps", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = get_model_shape(args.model)
    if args.layers:
        import dataclasses
        shape = dataclasses.replace(shape, num_layers=args.layers)
    gen = torch.Generator(device=device).manual_seed(0)
    src = random_megatron_tp(shape, args.train_tp, device, gen)
    src_bytes = sum(t.numel() * t.element_size() for st in src.states.values() for t in st.values())
    check_layer(src, device)
    bw = copy_bandwidth(device, 4 << 30 if device == "cuda" else 256 << 20, 10)
    rows = []
    for rtp in [int(x) for x in args.rollout_tps.split(",")]:
        reshard_once(src, rtp, device)  # warm-up (plans cached, allocator warm)
        results = {}
        times = []
        for _ in range(args.repeats):
            sec, nbytes, count = reshard_once(src, rtp, device)
            times.append(sec)
        results["stream (allocating, per-copy launches)"] = times
        progs = [VllmRefitProgram(src, rtp, r, device=device) for r in range(rtp)]
        nbytes_prog = sum(p.bytes for p in progs)
        ncopies = sum(p.num_copies for p in progs)
        results["program, per-copy launches"] = time_program(progs, args.repeats, batched=False, check=False)
        results["program, foreach batched"] = time_program(progs, args.repeats, batched=True, check=False)
        results["program, foreach + source check"] = time_program(progs, args.repeats, batched=True, check=True)
        if device == "cuda":
            try:
                for p in progs:
                    p.capture_cuda_graph()
                results["program, CUDA graph replay"] = time_program(progs, args.repeats, check=False)
            except Exception as err:  # report, keep the other numbers
                print(f"CUDA graph capture failed: {type(err).__name__}: {err}")
        # the program's output equals the streaming path's (spot check rank 0 every tensor)
        ref = dict(iter_vllm_rank(src, rtp, 0, device=device))
        for k, v in progs[0].tensors.items():
            assert torch.equal(v.view(torch.uint8), ref[k].view(torch.uint8)), k
        del ref
        for mode, ts in results.items():
            best = min(ts)
            nb = nbytes if mode.startswith("stream") else nbytes_prog
            rows.append({"train_tp": args.train_tp, "rollout_tp": rtp, "mode": mode, "bytes": nb,
                         "copies": ncopies, "tensors": count, "best_s": best, "median_s": sorted(ts)[len(ts) // 2],
                         "bytes_per_s": nb / best, "fraction_of_copy_bw": nb / best / bw})
        del progs
        if device == "cuda":
            torch.cuda.empty_cache()
    info = {"model": shape.name, "layers": shape.num_layers, "device": torch.cuda.get_device_name() if
            device == "cuda" else platform.processor(), "torch": torch.__version__, "source_bytes": src_bytes,
            "copy_bandwidth_bytes_per_s": bw, "rows": rows}
    print(f"{shape.name} ({shape.num_layers} layers) Megatron TP{args.train_tp} source {src_bytes / 2**30:.2f} GiB "
          f"on {info['device']}, torch {torch.__version__}")
    print(f"device copy bandwidth (one large copy_, bytes copied): {bw / 1e9:.1f} GB/s")
    print(f"{'TP2->':>6} {'mode':<38} {'GiB':>6} {'copies':>7} {'best s':>8} {'median s':>9} {'GB/s':>8} "
          f"{'% copy bw':>9}")
    for r in rows:
        print(f"{'TP' + str(r['rollout_tp']):>6} {r['mode']:<38} {r['bytes'] / 2**30:>6.2f} {r['copies']:>7} "
              f"{r['best_s']:>8.4f} {r['median_s']:>9.4f} {r['bytes_per_s'] / 1e9:>8.1f} "
              f"{100 * r['fraction_of_copy_bw']:>8.1f}%")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "reshard_bench.json"), "w") as fh:
            json.dump(info, fh, indent=2)


if __name__ == "__main__":
    main()
