"""NeMo-RL v0.7.0's own Megatron GRPO YAMLs load here: every key lands in one status (implemented / ignored /
refused), each file loads or is refused naming a key, `jetrl plan` passes or refuses with a reason; and
docs/nemo_rl_keys.md is the table the code implies.

The YAMLs come from NeMo-RL's release tarball (``JETRL_NEMO_RL_TARBALL`` or ``shared/upstream/`` beside the
checkout). Without it only the docs-table test runs; with ``JETRL_REQUIRE_UPSTREAM=1`` a missing tarball fails."""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest

from jetrl_megatron.errors import UserError
from jetrl_megatron.rl.config import nemo_rl_upstream as up
from jetrl_megatron.rl.config.nemo_rl_keys import IGNORED, IMPLEMENTED, REFUSED, classify
from jetrl_megatron.rl.config.run_config import REPO_ROOT, ConfigError, load_config_file
from jetrl_megatron.rl.config.schema import RunConfigFields
from jetrl_megatron.rl.config.yaml_tree import leaf_paths

DOC = REPO_ROOT / "docs" / "nemo_rl_keys.md"
_KEY_PATH = re.compile(r"^[a-z_][\w.]*\w: ")


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    tarball = up.find_tarball(REPO_ROOT)
    if tarball is None:
        if os.environ.get("JETRL_REQUIRE_UPSTREAM") == "1":
            pytest.fail(f"{up.TARBALL_NAME} not found (JETRL_NEMO_RL_TARBALL or shared/upstream/)")
        pytest.skip(f"{up.TARBALL_NAME} not found (set JETRL_NEMO_RL_TARBALL)")
    root = up.unpack(tarball, tmp_path_factory.mktemp("nemo_rl"))
    yamls = up.megatron_grpo_yamls(root)
    assert len(yamls) >= 50, f"expected NeMo-RL v0.7.0's ~61 Megatron GRPO YAMLs, found {len(yamls)}"
    return yamls


def test_every_key_of_every_yaml_has_a_status(upstream):
    statuses = Counter()
    for y in upstream:
        for key, value in leaf_paths(y.resolved).items():
            verdict = classify(key, value, RunConfigFields)
            assert verdict.status in (IMPLEMENTED, IGNORED, REFUSED), f"{y.path.name}: {key} = {value!r} is unknown"
            statuses[verdict.status] += 1
    print(f"\n{len(upstream)} NeMo-RL v0.7.0 Megatron GRPO YAMLs, key occurrences by status: {dict(statuses)}")


def test_each_yaml_loads_or_is_refused_naming_a_key_and_plans(upstream):
    from jetrl_megatron.rl.tools.run_plan import plan_report

    outcome = Counter()
    for y in upstream:
        try:
            cfg = load_config_file(y.path)
        except ConfigError as e:
            assert _KEY_PATH.match(str(e)), f"{y.path.name}: refusal does not start with a key path: {e}"
            outcome["refused at load"] += 1
            continue
        outcome["loaded"] += 1
        try:
            _, ok = plan_report(cfg, 80.0, show_config=False)
            outcome["plan passed" if ok else "plan failed (layout or memory, reported)"] += 1
        except (ConfigError, UserError) as e:
            assert _KEY_PATH.match(str(e)), f"{y.path.name}: plan refusal does not name a key: {e}"
            outcome["plan refused (named key)"] += 1
    print(f"\n{len(upstream)} YAMLs: {dict(outcome)}")
    assert outcome["loaded"] >= 10  # the dense Megatron recipes (Llama, Qwen2.5, ...) load


@pytest.mark.parametrize("name, preset", [
    ("grpo_math_8B_megatron_fp8.yaml", "llama3.1-8b"),
    ("grpo-llama3.1-8b-instruct-2n8g-megatron-fp8-e2e.yaml", "llama3.1-8b"),
    ("grpo-llama3.1-8b-instruct-1n8g-megatron-fp8-rollouts.v3.yaml", "llama3.1-8b"),
    ("grpo-qwen2.5-7b-instruct-4n8g-megatron.yaml", "qwen2.5-7b"),
])
def test_upstream_fp8_recipes_select_the_arm_and_plan(upstream, name, preset):
    from jetrl_megatron.rl.tools.run_plan import plan_report

    (y,) = [y for y in upstream if y.path.name == name]
    cfg = load_config_file(y.path, [f"policy.jet_rl.model_preset={preset}"])
    fp8_train = y.resolved["policy"]["megatron_cfg"].get("fp8_cfg", {}).get("enabled", False)
    precision = y.resolved["policy"]["generation"]["vllm_cfg"]["precision"]
    want = "jetrl" if fp8_train else ("bf16_train_fp8_rollout" if precision == "fp8" else "bf16")
    assert cfg.arm == want
    text, ok = plan_report(cfg, 141.0, show_config=False)
    assert ok, text


# Architectures NeMo-RL v0.7.0's YAMLs name that this project does not implement (a Mamba hybrid, a multimodal
# Qwen3.5): the only refusals the conformance test accepts, and only with a message naming the architecture.
UNSUPPORTED_ARCHITECTURES = {"nemotron_h": "NemotronHForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration"}


# NeMo-RL's FP8-rollout recipes (bf16_train_fp8_rollout, PP 2): before the in-place refit quantized the weights of
# its own pipeline stage one at a time, a BF16 scratch of every FP8 weight (13 GiB) took them to 81.4 GiB
FP8_ROLLOUT_PP2 = {"grpo-llama3.1-8b-instruct-1n8g-megatron-fp8-rollouts.v3.yaml",
                   "grpo-llama3.1-8b-instruct-1n8g-megatron-fp8-rollouts.v3-tq_simple.yaml"}

def test_every_loading_yaml_plans_unchanged_from_a_local_hub_cache(upstream, tmp_path, monkeypatch):
    """Every Megatron GRPO YAML that loads plans unchanged, for the cluster it names (80 GiB GPUs, NeMo-RL's H100s),
    with its model known only by hub id and the model's published config.json in an offline hub cache (as on a
    cluster with HF_HOME set), or its model's architecture is one of UNSUPPORTED_ARCHITECTURES and the refusal names
    it. Prints each outcome and the count; any other outcome (a supported model that stops planning) fails."""
    from hub_cache import write_config
    from huggingface_hub import constants
    from published_configs import PUBLISHED

    from jetrl_megatron.rl.tools.run_plan import plan_report

    cache = tmp_path / "hub"
    for repo_id, config in PUBLISHED.items():
        write_config(cache, repo_id, config)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    outcome: dict[str, str] = {}
    scratch: dict[str, float] = {}
    for y in upstream:
        try:
            cfg = load_config_file(y.path)
        except ConfigError:
            continue  # refused at load, naming a key (test above)
        assert cfg.hub.cache_dir == str(cache)
        try:
            text, ok = plan_report(cfg, 80.0, show_config=False)
            scratch[y.path.name] = next((float(ln.split()[1]) for ln in text.splitlines()
                                         if ln.strip().startswith("refit_quantize_scratch")), 0.0)
            outcome[y.path.name] = "OK" if ok else "; ".join(
                ln.strip() for ln in text.splitlines() if "REFUSED" in ln or "DOES NOT FIT" in ln)
        except (ConfigError, UserError) as e:
            outcome[y.path.name] = str(e)
    # the streamed half of the scratch (the other stage's weights, 6.5 GiB) stays: they plan OK with it on 80 GiB
    for name in FP8_ROLLOUT_PP2:
        assert outcome.get(name) == "OK" and 6.0 < scratch[name] < 7.0, (name, outcome.get(name), scratch.get(name))
    passed = sorted(n for n, o in outcome.items() if o == "OK")
    unsupported = {n: arch for n, o in outcome.items() for arch, cls in UNSUPPORTED_ARCHITECTURES.items()
                   if o.startswith("policy.model_name:") and f"model_type='{arch}'" in o and cls in o}
    refused = Counter(unsupported.values())
    print(f"\n`jetrl plan` from a local hub cache: {len(passed)} of {len(outcome)} loading YAMLs plan OK; "
          f"{len(unsupported)} refused: " + ", ".join(f"unsupported architecture {a} ({k})"
                                                      for a, k in refused.items()))
    for name, o in sorted(outcome.items()):
        print(f"  {name}: {o}")
    assert len(outcome) >= 17
    assert sorted(passed + list(unsupported)) == sorted(outcome), {
        n: o for n, o in outcome.items() if o != "OK" and n not in unsupported}
    assert len(passed) >= 16  # Llama-3.1-8B/70B, Llama-3.2-1B (BF16 at head_dim 64), Qwen2.5-1.5B/7B


def test_llama32_1b_fp8_arm_is_refused_naming_the_projection(upstream, tmp_path, monkeypatch):
    """The head_dim-64 Llama-3.2-1B YAML plans in its BF16 arm (above); switched to the jetrl arm (NeMo-RL's own
    FP8 switches) it is refused by the resharder preflight naming the projections, the sizes and what to run
    instead; bf16_train_fp8_rollout (the rollout quantizes the BF16 it receives) plans."""
    from hub_cache import write_config
    from huggingface_hub import constants
    from published_configs import PUBLISHED

    from jetrl_megatron.rl.tools.run_plan import plan_report

    write_config(tmp_path, "meta-llama/Llama-3.2-1B-Instruct", PUBLISHED["meta-llama/Llama-3.2-1B-Instruct"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    (y,) = [y for y in upstream if y.path.name == "grpo-llama3.2-1b-instruct-1n8g-megatron.yaml"]
    rollout = ["policy.generation.vllm_cfg.precision=fp8"]
    train = ["policy.megatron_cfg.fp8_cfg.enabled=true", "policy.megatron_cfg.fp8_cfg.fp8_recipe=blockwise"]
    cfg = load_config_file(y.path, rollout + train)
    assert cfg.arm == "jetrl"
    text, ok = plan_report(cfg, 80.0, show_config=False)
    assert not ok
    assert ("REFUSED [model] self_attn.q_proj/k_proj/v_proj: head_dim 64 is not a multiple of 128" in text
            and "q_size 2048, kv_size 512" in text and "run the bf16 arm" in text), text
    cfg = load_config_file(y.path, rollout)
    assert cfg.arm == "bf16_train_fp8_rollout"
    text, ok = plan_report(cfg, 80.0, show_config=False)
    assert ok, text


def test_docs_table_is_current(upstream):
    from jetrl_megatron.cli import KEYS_DOC_HEADER

    want = KEYS_DOC_HEADER + up.markdown_table(up.key_values(upstream))
    assert DOC.read_text() == want, "docs/nemo_rl_keys.md is stale: regenerate with `jetrl keys > docs/nemo_rl_keys.md`"


def test_docs_table_matches_the_code():
    """Runs without the tarball: each row's status and note are what rl/config/nemo_rl_keys.py says today, and every
    key of this project's schema has its row (a new ``policy.jet_rl`` key without one is caught here too)."""
    from jetrl_megatron.rl.config.schema import schema_defaults
    from jetrl_megatron.rl.config.yaml_tree import leaf_paths

    rows = [ln for ln in DOC.read_text().splitlines() if ln.startswith("| `")]
    assert len(rows) > 500
    documented = {row.split("`")[1] for row in rows}
    missing = sorted(k for k in leaf_paths(schema_defaults()) if k not in documented)
    assert not missing, f"docs/nemo_rl_keys.md lacks {missing}: regenerate with `jetrl keys > docs/nemo_rl_keys.md`"
    for row in rows:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        key = cells[0].strip("`")
        status, note = up.key_status(key)
        assert cells[1] == status, f"{key}: table says {cells[1]!r}, code says {status!r}"
        if len(cells) > 2:
            assert cells[2] == note.replace("|", "\\|"), f"{key}: note differs"


@pytest.mark.slow
def test_tiny_cpu_run_driven_by_an_upstream_yaml(upstream, tmp_path):
    """NeMo-RL's grpo_math_1B_megatron.yaml, as `jetrl run --config FILE k=v ...` takes it (run_grpo.py's form),
    pointed at the tiny preset and a synthetic task on CPU: it trains (optimizer steps applied, metrics logged)."""
    import json

    (y,) = [y for y in upstream if y.path.name == "grpo_math_1B_megatron.yaml"]
    log_dir = tmp_path / "run"
    overrides = [
        "policy.model_name=tiny", "policy.jet_rl.model_preset=tiny", "cluster.gpus_per_node=0", "cluster.num_nodes=1",
        "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2",
        "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8",
        "policy.max_total_sequence_length=16", "policy.generation.max_new_tokens=4", "data.max_input_seq_length=16",
        "data.train.dataset_name=synthetic_sort", "data.train.num_items=3", "checkpointing.enabled=false",
        f"logger.log_dir={log_dir}", "logger.tensorboard_enabled=false", "policy.jet_rl.progress_bars=false",
        "policy.jet_rl.plot_enabled=false", "policy.generation.vllm_cfg.enforce_eager=true",
    ]
    from warm_cli import run_cli

    r = run_cli(["run", "--config", str(y.path), "--arm", "jetrl", *overrides], timeout=900, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "have no effect here" in r.stderr  # the ignored NeMo-RL keys (sequence packing, DTensor, ...) warned once
    rows = [json.loads(ln) for ln in (log_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row["step"] > 0]
    assert [row["step"] for row in steps] == [1, 2]
    assert all(row["train/skipped_steps"] == 0 and row["train/fp8_generation"] > 0 for row in steps)
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["ok"] and summary["mode"] == "jetrl"
