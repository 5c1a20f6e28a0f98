"""`jetrl plan --recommend`: which trainer and rollout layout to run a recipe with on a given cluster.

Why a separate pass and not a second estimator: every candidate layout is loaded as the recipe plus three overrides
(trainer TP, PP, rollout TP) and put through the plain plan (:func:`rl.plan.plan_report`: resharder preflight, GPU
and host memory) and its :func:`rl.plan.memory_estimate`, so a recommended layout passes `jetrl plan` with the very
numbers shown here. What this module adds is only the enumeration and the ranking rule (:data:`RULE`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from jetrl_megatron.rl.config import ConfigError, RunConfig, load_config
from jetrl_megatron.rl.tools.run_plan import (
    PHASE_TOTALS,
    PlanMachine,
    memory_estimate,
    model_shape,
    parallel_layout,
    plan_machine,
    plan_report,
    refit_buffers,
)

TP_KEY = "policy.megatron_cfg.tensor_model_parallel_size"
PP_KEY = "policy.megatron_cfg.pipeline_model_parallel_size"
ROLLOUT_TP_KEY = "policy.generation.vllm_cfg.tensor_parallel_size"
HEADROOM = 0.10  # a layout "fits" with at least this share of the GPU left free (allocator fragmentation, CUDA
# contexts, NCCL buffers and libraries are not in the estimate)

RULE = (f"ranking: 1) fits with >= {HEADROOM:.0%} GPU headroom (peak <= {1 - HEADROOM:.0%} of --gpu-mem-gib), host "
        "memory per node within --host-mem-gib when given, and room for a KV cache next to vLLM's weights; then fits "
        f"with < {HEADROOM:.0%} headroom; then does not fit (closest first); then refused. Among layouts that fit: "
        "2) smallest model-parallel size TP x PP (so DP is largest: least trainer communication per token), "
        "3) smaller PP (fewer pipeline bubbles), 4) fewer rollout KV waves (ceil(full batch KV / KV budget): more "
        "of the rollout batch decodes at once), 5) smaller rollout TP (more engines, fewer all-reduces per token), "
        "6) fewer refit bytes received from peers per step, 7) lower peak GPU memory, 8) smaller (TP, PP, rollout TP)")

TIER_WORDS = ("fits", f"fits (<{HEADROOM:.0%} headroom)", "DOES NOT FIT", "refused")


def divisors(n: int) -> list[int]:
    """Divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_choices(gpus_per_node: int, num_nodes: int, num_layers: int) -> list[tuple[int, int, int]]:
    """(trainer TP, PP, rollout TP) to try: both TPs within a node (they divide the node's GPUs: TP traffic stays on
    NVLink), PP dividing the layers, TP x PP dividing the world (DP = world / (TP x PP)). Whether TP splits the
    heads and the FFN into whole heads and 128-blocks is the resharder preflight's call, made per candidate."""
    if gpus_per_node < 1:
        raise ConfigError(f"cluster.gpus_per_node: --recommend lays out GPUs, got {gpus_per_node} (a CPU recipe); set "
                          "cluster.gpus_per_node >= 1")
    if num_nodes < 1:
        raise ConfigError(f"cluster.num_nodes: must be >= 1, got {num_nodes}")
    world = gpus_per_node * num_nodes
    return [(tp, pp, rtp) for tp in divisors(gpus_per_node) for pp in divisors(num_layers)
            if world % (tp * pp) == 0 for rtp in divisors(gpus_per_node)]


@dataclass
class Candidate:
    """One layout and what the plain plan said about it."""

    tp: int
    pp: int
    dp: int
    rollout_tp: int
    tier: int  # index into TIER_WORDS
    why: str = ""  # what failed (tiers 2 and 3)
    mem: dict[str, float] = field(default_factory=dict)  # memory_estimate, GiB
    peak_gib: float = math.inf
    peak_phase: str = ""
    kv_waves: int | None = None  # None: no KV room
    refit_peers: int = 0  # bytes the busiest-buffer rank receives from its model-parallel peers per refit
    refit_in_place: int = 0  # bytes its own vLLM rank copies from its own tensors, read in place

    @property
    def mp(self) -> int:
        return self.tp * self.pp

    @property
    def overrides(self) -> list[str]:
        return [f"{TP_KEY}={self.tp}", f"{PP_KEY}={self.pp}", f"{ROLLOUT_TP_KEY}={self.rollout_tp}"]

    def sort_key(self) -> tuple:
        """The ranking rule (:data:`RULE`) as a sort key."""
        names = (self.tp, self.pp, self.rollout_tp)
        if self.tier <= 1:
            waves = self.kv_waves if self.kv_waves is not None else math.inf
            return (self.tier, self.mp, self.pp, waves, self.rollout_tp, self.refit_peers, self.peak_gib, names)
        if self.tier == 2:
            return (self.tier, self.peak_gib, names)
        return (self.tier, names)


def evaluate(recipe: str, overrides: list[str], tp: int, pp: int, rollout_tp: int, gpu_mem_gib: float,
             host_mem_gib: float | None) -> Candidate:
    """The plain plan of ``recipe`` + ``overrides`` at this layout, condensed to one :class:`Candidate`."""
    layout_ov = [f"{TP_KEY}={tp}", f"{PP_KEY}={pp}", f"{ROLLOUT_TP_KEY}={rollout_tp}"]
    try:
        cfg = load_config(recipe, [*overrides, *layout_ov])
        shape = model_shape(cfg)
        layout = parallel_layout(cfg)
    except ConfigError as e:
        return Candidate(tp, pp, 0, rollout_tp, tier=3, why=str(e))
    # the plain plan's own preflight verdict (its REFUSED lines), not a second call with other arguments
    text, ok = plan_report(cfg, gpu_mem_gib, show_config=False, host_mem_gib=host_mem_gib)
    viol = [ln.strip().removeprefix("REFUSED ") for ln in text.splitlines() if ln.startswith("  REFUSED ")]
    if viol:
        more = f" (+{len(viol) - 1} more)" if len(viol) > 1 else ""
        return Candidate(tp, pp, layout.dp, rollout_tp, tier=3, why=f"resharder: {viol[0]}{more}")
    mem = memory_estimate(cfg, shape, layout, gpu_mem_gib)
    phase = max(PHASE_TOTALS, key=lambda k: mem[k])  # of equal totals the first: the earlier phase in a step
    peak, phase = mem[phase], phase.removesuffix("_phase_total")
    busiest = refit_buffers(cfg, shape, layout)
    peers, own = (busiest[1].received, busiest[1].own) if busiest and layout.tp * layout.pp > 1 else (0, 0)
    budget = mem["kv_cache_budget"]
    waves = max(1, math.ceil(mem["kv_cache_full_batch"] / budget)) if budget > 0 else None
    c = Candidate(tp, pp, layout.dp, rollout_tp, tier=0, mem=mem, peak_gib=peak, peak_phase=phase, kv_waves=waves,
                  refit_peers=peers, refit_in_place=own)
    problems = []
    if peak > gpu_mem_gib:
        problems.append(f"GPU peak {peak:.1f} > {gpu_mem_gib:g} GiB ({phase} phase)")
    if host_mem_gib is not None and mem["host_per_node"] > host_mem_gib:
        problems.append(f"host {mem['host_per_node']:.1f} > {host_mem_gib:g} GiB per node")
    if waves is None:
        problems.append(f"vLLM's budget holds only its weights ({mem['vllm_weights']:.1f} GiB), no KV cache")
    if problems:
        c.tier, c.why = 2, "; ".join(problems)
    elif peak > (1 - HEADROOM) * gpu_mem_gib:
        c.tier = 1
    if (c.tier <= 1) != ok and waves is not None:  # the two verdicts come from the same numbers
        raise RuntimeError(f"recommender and plain plan disagree on TP{tp} PP{pp} rollout TP{rollout_tp}")
    return c


def recommend(recipe: str, overrides: list[str], gpu_mem_gib: float | None = None,
              host_mem_gib: float | None = None) -> tuple[RunConfig, list[Candidate], PlanMachine]:
    """The base config (layout keys reset to 1, so any cluster size loads), every candidate, best first, and the
    machine they were checked against (`run_plan.plan_machine`: these sizes, else the recipe's, else this GPU's)."""
    base = load_config(recipe, [*overrides, f"{TP_KEY}=1", f"{PP_KEY}=1", f"{ROLLOUT_TP_KEY}=1"])
    machine = plan_machine(base, gpu_mem_gib, host_mem_gib)
    shape = model_shape(base)
    choices = layout_choices(base.cluster.gpus_per_node, base.cluster.num_nodes, shape.num_layers)
    cands = [evaluate(recipe, overrides, tp, pp, rtp, machine.gpu_mem_gib, machine.host_mem_gib)
             for tp, pp, rtp in choices]
    return base, sorted(cands, key=Candidate.sort_key), machine


def _gib(n: float) -> str:
    return f"{n / 1024**3:.2f}"


def _reason(c: Candidate, best: Candidate | None) -> str:
    """Why this row sits where it does: its failure, or the first rule it loses on against the recommended row."""
    if c.tier >= 2:
        return c.why
    if best is None or c is best:
        return (f"recommended: {TIER_WORDS[c.tier]}, smallest TP x PP = {c.mp} that fits (DP {c.dp}), PP{c.pp}, "
                f"{c.kv_waves} KV wave(s) at rollout TP{c.rollout_tp}")
    if c.tier != best.tier:
        return f"under {HEADROOM:.0%} headroom"
    steps = [(c.mp, best.mp, f"TP x PP {c.mp} > {best.mp}"), (c.pp, best.pp, f"PP {c.pp} > {best.pp}"),
             (c.kv_waves, best.kv_waves, f"KV waves {c.kv_waves} > {best.kv_waves}"),
             (c.rollout_tp, best.rollout_tp, f"rollout TP {c.rollout_tp} > {best.rollout_tp}"),
             (c.refit_peers, best.refit_peers, f"refit from peers {_gib(c.refit_peers)} > {_gib(best.refit_peers)}"),
             (c.peak_gib, best.peak_gib, f"peak {c.peak_gib:.1f} > {best.peak_gib:.1f} GiB")]
    for mine, theirs, text in steps:
        if mine != theirs:
            return text
    return "tie: smaller (TP, PP, rollout TP) first"


def recommend_report(recipe: str, overrides: list[str], gpu_mem_gib: float | None = None,
                     host_mem_gib: float | None = None) -> tuple[str, bool, Candidate | None, PlanMachine]:
    """The text `jetrl plan --recommend` prints, whether any layout fits, the recommended candidate and the machine
    it was checked against."""
    base, cands, machine = recommend(recipe, overrides, gpu_mem_gib, host_mem_gib)
    gpu_mem_gib, host_mem_gib = machine.gpu_mem_gib, machine.host_mem_gib
    shape = model_shape(base)
    cl = base.cluster
    host = f"{host_mem_gib:g} GiB host per node" if host_mem_gib is not None else "host memory not checked"
    best = cands[0] if cands and cands[0].tier <= 1 else None
    lines = [
        f"# recommend: {base.name} (arm {base.arm}), {shape.name} ({shape.num_layers} layers, "
        f"{shape.num_attention_heads}/{shape.num_kv_heads} heads, ffn {shape.ffn_hidden_size}) on {cl.num_nodes} "
        f"node(s) x {cl.gpus_per_node} GPU(s) = {base.world_size} GPUs of {gpu_mem_gib:g} GiB; {host}",
        f"# {len(cands)} candidates: trainer TP | {cl.gpus_per_node} (within a node) x PP | {shape.num_layers} "
        f"layers x DP = {base.world_size}, rollout TP | {cl.gpus_per_node}; each one the plain `jetrl plan` with "
        f"{TP_KEY}, {PP_KEY} and {ROLLOUT_TP_KEY} set (resharder preflight + rl/tools/run_plan.py memory_estimate; "
        "vLLM's budget is the recipe's, not tuned here)",
        f"# checked against: {machine.source}",
        f"# {RULE}",
        "# columns: peak = max(rollout, logprob, train, refit phase) GiB per GPU, busiest pipeline stage; host = GiB "
        "per node; waves = rollout KV waves; refit = GiB per GPU per step received from model-parallel peers + copied "
        "in place (busiest-buffer rank; '-' = TP x PP 1: the engine reads the trainer's tensors in place)",
        f"{'#':>3} {'TP':>2} {'PP':>2} {'DP':>3} {'rTP':>3}  {'verdict':<18} {'peak GiB':>14} {'host':>7} "
        f"{'waves':>5} {'refit GiB':>13}  reason",
    ]
    for i, c in enumerate(cands, 1):
        if c.tier == 3:
            lines.append(f"{i:>3} {c.tp:>2} {c.pp:>2} {c.dp or '-':>3} {c.rollout_tp:>3}  {TIER_WORDS[3]:<18} "
                         f"{'-':>14} {'-':>7} {'-':>5} {'-':>13}  {c.why}")
            continue
        refit = "-" if c.mp == 1 else f"{_gib(c.refit_peers)}+{_gib(c.refit_in_place)}"
        lines.append(f"{i:>3} {c.tp:>2} {c.pp:>2} {c.dp:>3} {c.rollout_tp:>3}  {TIER_WORDS[c.tier]:<18} "
                     f"{c.peak_gib:6.1f} ({c.peak_phase:<7}) {c.mem['host_per_node']:7.1f} "
                     f"{c.kv_waves if c.kv_waves is not None else '-':>5} {refit:>13}  {_reason(c, best)}")
    if best is None:
        lines.append("# recommended: none: no layout fits this cluster")
    else:
        lines.append(f"# recommended: trainer TP{best.tp} x PP{best.pp} x DP{best.dp}, rollout TP{best.rollout_tp} "
                     f"({base.world_size // best.rollout_tp} engines): peak {best.peak_gib:.1f} GiB per GPU "
                     f"({best.peak_phase} phase, {1 - best.peak_gib / gpu_mem_gib:.0%} free), host "
                     f"{best.mem['host_per_node']:.1f} GiB per node")
        lines.append("#   overrides: " + " ".join(best.overrides))
    return "\n".join(lines), best is not None, best, machine
