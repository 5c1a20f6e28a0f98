"""`jetrl plan --recommend` (rl/tools/recommend_layout.py): the ranking on a small synthetic cluster against an
enumeration and a ranking written here from the stated rule, every recommended layout passing the plain plan with
the same numbers, and a bad cluster refused with one line naming the key. CPU, arithmetic only (no process groups,
no engines)."""

from __future__ import annotations

import math

import pytest

from jetrl_megatron.cli import main
from jetrl_megatron.rl.config import ConfigError, load_config
from jetrl_megatron.rl.tools.recommend_layout import recommend
from jetrl_megatron.rl.tools.run_plan import memory_estimate, model_shape, parallel_layout, plan_report, refit_buffers

# tiny preset (4 layers, 4/2 heads, FFN 768 = 6 blocks) on 2 nodes x 4 GPUs of 1.25 GiB, 4K-token micro-batches: the
# four verdicts all occur (fits, < 10% headroom, does not fit, refused by the batch split and by the resharder)
OVERRIDES = ["cluster.gpus_per_node=4", "cluster.num_nodes=2", "policy.max_total_sequence_length=4096",
             "policy.generation.vllm_cfg.max_model_len=4096"]
GPU_GIB = 1.25
LAYOUT = ("policy.megatron_cfg.tensor_model_parallel_size", "policy.megatron_cfg.pipeline_model_parallel_size",
          "policy.generation.vllm_cfg.tensor_parallel_size")


@pytest.fixture(scope="module")
def ranked():
    return recommend("tiny_cpu", OVERRIDES, GPU_GIB)[1]


def _independent_ranking() -> list[tuple[int, int, int]]:
    """Enumerate by hand (both TPs divide the node's 4 GPUs, PP the 4 layers, TP x PP the 8 GPUs), judge each layout
    by the plain plan's verdict and estimate, and order by the rule as the docs state it."""
    gpn, world, layers = 4, 8, 4
    rows = []
    for tp in (t for t in range(1, gpn + 1) if gpn % t == 0):
        for pp in (p for p in range(1, layers + 1) if layers % p == 0 and world % (tp * p) == 0):
            for rtp in (r for r in range(1, gpn + 1) if gpn % r == 0):
                layout_ov = [f"{k}={v}" for k, v in zip(LAYOUT, (tp, pp, rtp), strict=True)]
                cfg = load_config("tiny_cpu", [*OVERRIDES, *layout_ov])
                shape = model_shape(cfg)
                try:
                    layout = parallel_layout(cfg)
                except ConfigError:
                    rows.append(((3, (tp, pp, rtp)), (tp, pp, rtp)))
                    continue
                text, ok = plan_report(cfg, GPU_GIB, show_config=False)
                if "REFUSED" in text:  # the plain plan's resharder preflight
                    rows.append(((3, (tp, pp, rtp)), (tp, pp, rtp)))
                    continue
                m = memory_estimate(cfg, shape, layout, GPU_GIB)
                peak = max(m[k] for k in ("logprob_phase_total", "train_phase_total", "refit_phase_total",
                                          "rollout_phase_total"))
                waves = math.ceil(m["kv_cache_full_batch"] / m["kv_cache_budget"])
                if not ok:
                    key = (2, peak, (tp, pp, rtp))
                else:
                    tier = 0 if peak <= 0.9 * GPU_GIB else 1
                    busiest = refit_buffers(cfg, shape, layout)
                    peers = busiest[1].received if busiest and tp * pp > 1 else 0
                    key = (tier, tp * pp, pp, waves, rtp, peers, peak, (tp, pp, rtp))
                rows.append((key, (tp, pp, rtp)))
    return [name for _, name in sorted(rows)]


def test_ranking_matches_an_independent_enumeration(ranked):
    got = [(c.tp, c.pp, c.rollout_tp) for c in ranked]
    assert got == _independent_ranking()
    tiers = [c.tier for c in ranked]
    assert tiers == sorted(tiers) and set(tiers) == {0, 1, 2, 3}
    best = ranked[0]
    # the smallest TP x PP that fits with headroom wins; below it only layouts that do not fit or are refused
    assert best.tier == 0 and all(c.mp >= best.mp for c in ranked if c.tier == 0)
    assert all(c.tier >= 2 for c in ranked if c.mp < best.mp)


def test_every_fitting_layout_passes_the_plain_plan_with_the_same_numbers(ranked):
    fitting = [c for c in ranked if c.tier <= 1]
    assert fitting
    for c in fitting:
        cfg = load_config("tiny_cpu", [*OVERRIDES, *c.overrides])
        text, ok = plan_report(cfg, GPU_GIB, show_config=False)
        assert ok, text
        assert f"peak {c.peak_gib:.1f} GiB of {GPU_GIB:.0f} GiB: fits" in text
        assert memory_estimate(cfg, model_shape(cfg), parallel_layout(cfg), GPU_GIB) == c.mem
        assert f"world size 8: trainer TP{c.tp} x PP{c.pp} x DP{c.dp}" in text
    for c in ranked:
        if c.tier == 2:
            cfg = load_config("tiny_cpu", [*OVERRIDES, *c.overrides])
            assert not plan_report(cfg, GPU_GIB, show_config=False)[1]


def test_cli_prints_the_table_and_the_check_command(capsys):
    assert main(["plan", "--recommend", "--recipe", "tiny_cpu", "--gpu-mem-gib", f"{GPU_GIB:g}", *OVERRIDES]) == 0
    out = capsys.readouterr().out
    assert "# ranking: 1) fits with >= 10% GPU headroom" in out and "smallest model-parallel size TP x PP" in out
    assert "# recommended: trainer TP1 x PP4 x DP2, rollout TP1" in out
    assert f"check it: jetrl plan --recipe tiny_cpu --no-config --gpu-mem-gib {GPU_GIB:g}" in out
    assert "plan --recommend: OK" in out


@pytest.mark.parametrize(("args", "key"), [
    (["--recipe", "tiny_cpu"], "cluster.gpus_per_node"),  # a CPU recipe: no GPUs to lay out
    (["--recipe", "tiny_cpu", "cluster.gpus_per_node=4", "cluster.num_nodes=0"], "cluster.num_nodes"),
    (["--recipe", "tiny_cpu", "cluster.gpus_per_node=-2"], "cluster.gpus_per_node"),
    (["--recipe", "tiny_cpu", "cluster.gpus_per_node=4", "--gpu-mem-gib", "0"], "--gpu-mem-gib"),
])
def test_bad_cluster_is_one_clear_error(capsys, args, key):
    assert main(["plan", "--recommend", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith(f"jetrl plan: {key}")
