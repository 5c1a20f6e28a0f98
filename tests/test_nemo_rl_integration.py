"""The NeMo-RL v0.7.0 integration (``jetrl_megatron/nemo_rl/``) against NeMo-RL's release tarball, without
importing NeMo-RL's heavy modules (no Ray, Megatron-Bridge or TransformerEngine here).

* The contract: every NeMo-RL class, method, import and call the glue relies on (``contract.TOUCHES``) holds at
  v0.7.0, read with ``ast``; a changed signature, a renamed call or a removed method is reported (the checker is run
  on edited copies of NeMo-RL's files); the glue modules reference nothing of NeMo-RL outside the table, and the
  worker class overrides exactly the table's ``override`` methods.
* The config keys the integration reads exist in NeMo-RL (its base GRPO YAMLs, or its code for keys it reads with a
  default); the example recipe loads with NeMo-RL's own loader and passes the worker's checks; the driver's
  preflight refuses a bad override naming the key.
* ``patches/nemo-rl-v0.7.0-jetrl-worker.patch`` applies (``git apply --check``) and, applied, selects the worker from
  ``policy.worker_cls`` and registers its environment from the ``nemo_rl.actor_environments`` entry points.
* ``check_policy``: a valid policy passes; each thing the worker cannot run is refused naming its key.

The tarball comes from ``JETRL_NEMO_RL_TARBALL`` or ``shared/upstream/`` (as in test_nemo_rl_conformance.py).
"""

from __future__ import annotations

import ast
import copy
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest
from nemo_rl_standin import policy_config

from jetrl_megatron.model.shapes import get_model_shape
from jetrl_megatron.nemo_rl import contract
from jetrl_megatron.nemo_rl.policy_cfg import PolicyConfigError, check_policy, jetrl_vllm_kwargs
from jetrl_megatron.nemo_rl.registry import ACTOR_ENVIRONMENTS, MEGATRON_WORKER_FQN, WORKER_FQN
from jetrl_megatron.recipe import Fp8Recipe
from jetrl_megatron.rl.config import REPO_ROOT
from jetrl_megatron.rl.config import nemo_rl_upstream as up

GLUE = REPO_ROOT / "jetrl_megatron" / "nemo_rl"
PATCH = REPO_ROOT / "patches" / "nemo-rl-v0.7.0-jetrl-worker.patch"
RECIPE = REPO_ROOT / "recipes" / "nemo_rl" / "grpo_math_8B_megatron_jetrl.yaml"


@pytest.fixture(scope="module")
def nemo_root(tmp_path_factory) -> Path:
    tarball = up.find_tarball(REPO_ROOT)
    if tarball is None:
        if os.environ.get("JETRL_REQUIRE_UPSTREAM") == "1":
            pytest.fail(f"{up.TARBALL_NAME} not found (JETRL_NEMO_RL_TARBALL or shared/upstream/)")
        pytest.skip(f"{up.TARBALL_NAME} not found (set JETRL_NEMO_RL_TARBALL to NeMo-RL v0.7.0's release tarball)")
    dest = tmp_path_factory.mktemp("nemo_rl_src")
    with tarfile.open(tarball) as tf:
        tf.extractall(dest, filter="data")
    (root,) = [p for p in dest.iterdir() if p.is_dir()]
    assert (root / contract.MPW).is_file()
    return root


def _edited_root(src: Path, dst: Path, path: str, old: str, new: str) -> Path:
    """A copy of ``path`` (only) from ``src`` with ``old`` replaced by ``new`` (which must occur)."""
    text = (src / path).read_text(encoding="utf-8")
    assert old in text, f"{path}: {old!r} not found; the test's edit is stale"
    (dst / path).parent.mkdir(parents=True, exist_ok=True)
    (dst / path).write_text(text.replace(old, new), encoding="utf-8")
    return dst


def _touches(path: str) -> tuple[contract.Touch, ...]:
    return tuple(t for t in contract.TOUCHES if t.path == path)


# ------------------------------------------------------------------------------------------------ the contract
def test_contract_holds_at_v070(nemo_root):
    assert contract.check_source(nemo_root) == []
    assert contract.main([str(nemo_root)]) == 0


@pytest.mark.parametrize(("path", "old", "new", "expect"), [
    (contract.MPW, "def _iter_params_with_optional_kv_scales(\n        self,\n        kv_scales:",
     "def _iter_params_with_optional_kv_scales(\n        self,\n        scales:",
     "parameters are ('self', 'scales'), expected ('self', 'kv_scales')"),
    (contract.MPW, "            params_generator=self._iter_params_with_optional_kv_scales(",
     "            params_generator=self._export_hf_params(",
     "stream_weights_via_ipc_zmq: does not call self._iter_params_with_optional_kv_scales"),
    (contract.MPW, "    def use_reference_model(self):", "    def use_reference_policy(self):",
     "use_reference_model: not found"),
    (contract.MPW, "        model_and_optimizer_state = setup_model_and_optimizer(",
     "        model_and_optimizer_state = megatron_setup.setup_model_and_optimizer(",
     "__init__: does not call setup_model_and_optimizer"),
    (contract.SETUP, "    load_optimizer: bool = True,", "    init_optimizer: bool = True,",
     "setup_model_and_optimizer: parameters are"),
    (contract.REGISTRY, f'    "{MEGATRON_WORKER_FQN}": MCORE_EXECUTABLE,\n', "",
     f"does not mention {MEGATRON_WORKER_FQN!r}"),
    (contract.LM_POLICY, "            worker_builder_cls_fqn = resolve_policy_worker_cls(\n"
     '                "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker",',
     "            worker_builder_cls_fqn = resolve_policy_worker_cls(\n"
     '                "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorkerV2",',
     f"Policy.__init__: does not mention {MEGATRON_WORKER_FQN!r}"),
])
def test_contract_reports_a_changed_upstream(nemo_root, tmp_path, path, old, new, expect):
    """Each edit of NeMo-RL's source that would break the glue is reported, naming the file, symbol and change."""
    edited = _edited_root(nemo_root, tmp_path, path, old, new)
    problems = contract.check_source(edited, _touches(path))
    assert any(expect in p for p in problems), problems
    assert all(p.startswith(path) for p in problems)


def _nemo_references(file: Path, nemo_root: Path) -> set[tuple[str, str]]:
    """(NeMo-RL file, top-level name) of every NeMo-RL symbol ``file`` imports or reads from a NeMo-RL module."""
    tree = ast.parse(file.read_text(encoding="utf-8"))
    modules: dict[str, str] = {}  # local alias -> NeMo-RL module file
    refs: set[tuple[str, str]] = set()

    def module_file(dotted: str) -> str | None:
        rel = dotted.replace(".", "/")
        if (nemo_root / f"{rel}.py").is_file():
            return f"{rel}.py"
        if (nemo_root / rel / "__init__.py").is_file():
            return f"{rel}/__init__.py"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("nemo_rl"):
                    if a.asname:
                        modules[a.asname] = module_file(a.name)
                    else:
                        modules[a.name.split(".")[0]] = module_file(a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nemo_rl"):
            for a in node.names:
                sub = module_file(f"{node.module}.{a.name}")
                if sub is not None:
                    modules[a.asname or a.name] = sub
                else:
                    refs.add((module_file(node.module), a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            if not node.attr.startswith("__"):
                refs.add((modules[node.value.id], node.attr))
    return refs


def test_glue_touches_only_the_table(nemo_root):
    table = {(t.path, t.name.split(".")[0]) for t in contract.TOUCHES}
    seen = set()
    for file in sorted(GLUE.glob("*.py")):
        refs = _nemo_references(file, nemo_root)
        missing = sorted(refs - table)
        assert not missing, f"{file.name} uses NeMo-RL names that contract.TOUCHES does not list: {missing}"
        seen |= refs
    assert (contract.MPW, "MegatronPolicyWorkerImpl") in seen and (contract.MPW, "setup_model_and_optimizer") in seen

    worker = ast.parse((GLUE / "worker.py").read_text(encoding="utf-8"))
    (impl,) = [n for n in worker.body if isinstance(n, ast.ClassDef) and n.name == "JetRLMegatronPolicyWorkerImpl"]
    defined = {n.name for n in impl.body if isinstance(n, ast.FunctionDef)}
    overrides = {t.name.split(".")[-1] for t in contract.TOUCHES if t.override}
    assert defined == overrides
    upstream = {t.name.split(".")[-1]: t.params for t in contract.TOUCHES if t.override}
    for fn in impl.body:  # our overrides keep NeMo-RL's parameter names (callers pass them by keyword)
        if isinstance(fn, ast.FunctionDef) and fn.name != "__init__":
            assert contract.params_of(fn) == upstream[fn.name], fn.name


def _yaml_keys(nemo_root: Path, name: str) -> dict:
    from jetrl_megatron.rl.config.yaml_tree import load_tree, resolve_tree

    saved = os.environ.get("HF_HOME")
    os.environ["HF_HOME"] = "<HF_HOME>"
    try:
        return resolve_tree(load_tree(nemo_root / name))
    finally:
        if saved is None:
            os.environ.pop("HF_HOME")
        else:
            os.environ["HF_HOME"] = saved


def _has(tree: dict, dotted: str) -> bool:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_config_keys_exist_in_nemo_rl(nemo_root):
    resolved = _yaml_keys(nemo_root, contract.CONFIG_YAML)
    literals = set()
    for py in (nemo_root / "nemo_rl").rglob("*.py"):
        for n in ast.walk(ast.parse(py.read_text(encoding="utf-8"))):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                literals.add(n.value)
    for key, where in contract.CONFIG_KEYS.items():
        if where == "yaml":
            assert _has(resolved, key), f"{key}: not in NeMo-RL's {contract.CONFIG_YAML}"
        elif where == "code":
            assert key.rsplit(".", 1)[1] in literals, f"{key}: NeMo-RL's code never reads it"
        else:
            assert _has(resolved, key.split(".vllm_kwargs.")[0] + ".vllm_kwargs"), key
    # what the worker handles, as NeMo-RL's defaults have it
    ddp = resolved["policy"]["megatron_cfg"]["distributed_data_parallel_config"]
    assert ddp["overlap_param_gather"] is True and resolved["policy"]["megatron_cfg"]["optimizer"][
        "use_distributed_optimizer"] is True


def _nemo_python(nemo_root: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(nemo_root), str(REPO_ROOT)])}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def _nemo_output_lines(nemo_root: Path, code: str, cwd: Path) -> list[str]:
    """stdout lines of ``code`` run beside NeMo-RL's source; fails with its stderr when it exits non-zero."""
    out = _nemo_python(nemo_root, code, cwd)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()


def test_example_recipe_loads_with_nemo_rls_loader_and_passes(nemo_root, tmp_path):
    configs = nemo_root / "examples" / "configs"
    shutil.copy(RECIPE, configs / RECIPE.name)
    code = ("import json; from omegaconf import OmegaConf; "
            "from nemo_rl.utils.config import load_config, register_omegaconf_resolvers; "
            "register_omegaconf_resolvers(); "
            f"print(json.dumps(OmegaConf.to_container(load_config({str(configs / RECIPE.name)!r}), resolve=True)))")
    cfg = json.loads(_nemo_output_lines(nemo_root, code, tmp_path)[-1])
    policy = cfg["policy"]
    shape = get_model_shape("llama3.1-8b")
    assert policy["model_name"] == "meta-llama/Llama-3.1-8B-Instruct"
    recipe = check_policy(policy, shape.num_layers)
    assert recipe == Fp8Recipe()
    assert policy["generation"]["vllm_kwargs"] == jetrl_vllm_kwargs(recipe, shape.num_layers)
    assert policy["worker_cls"] == WORKER_FQN and policy["megatron_cfg"]["pipeline_model_parallel_size"] == 2


def test_driver_preflight_uses_nemo_rls_loader(nemo_root, tmp_path):
    configs = nemo_root / "examples" / "configs"
    shutil.copy(RECIPE, configs / RECIPE.name)
    model = tmp_path / "tiny_llama"
    model.mkdir()
    tiny = get_model_shape("tiny")
    cfg = dict(tiny.to_hf_config(), model_type="llama", architectures=["LlamaForCausalLM"])
    (model / "config.json").write_text(json.dumps(cfg))
    code = (f"from jetrl_megatron.nemo_rl.run_grpo import preflight\n"
            f"cfg, model = {str(configs / RECIPE.name)!r}, 'policy.model_name={model}'\n"
            "p = preflight(cfg, [model])\n"
            "print('OK', p.shape.num_layers, p.recipe.mode, p.sequence_parallel)\n"
            "try:\n"
            "    preflight(cfg, [model, 'policy.generation.vllm_cfg.precision=fp8'])\n"
            "except Exception as e:\n"
            "    print('REFUSED', type(e).__name__, e)\n")
    out = _nemo_python(nemo_root, code, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert f"OK {tiny.num_layers} jetrl False" in lines
    refused = [ln for ln in lines if ln.startswith("REFUSED")]
    assert refused and "PolicyConfigError policy.generation.vllm_cfg.precision: 'fp8'" in refused[0], lines


def test_driver_runs_nemo_rls_own_fp8_yaml_as_jetrl_in_the_hosted_form(nemo_root, tmp_path):
    """NeMo-RL's grpo_math_8B_megatron_fp8.yaml (the standalone form: fp8_cfg.enabled + blockwise + precision fp8;
    sequence packing off, which the Jet-RL attention needs), loaded by NeMo-RL's own loader: the driver selects
    jetrl and hands NeMo-RL the hosted form (its TE FP8 and vLLM re-quantization off, jetrl_fp8 with the recipe),
    which the worker's check accepts."""
    configs = nemo_root / "examples" / "configs"
    model = tmp_path / "tiny_llama"
    model.mkdir()
    tiny = get_model_shape("tiny")
    (model / "config.json").write_text(json.dumps(dict(tiny.to_hf_config(), model_type="llama",
                                                       architectures=["LlamaForCausalLM"])))
    code = ("import json\n"
            "from jetrl_megatron.nemo_rl.run_grpo import load_checked\n"
            f"plan, cfg = load_checked({str(configs / 'grpo_math_8B_megatron_fp8.yaml')!r}, "
            f"['policy.model_name={model}', 'policy.sequence_packing.enabled=false'])\n"
            "print(json.dumps([plan.recipe.to_dict(), cfg['policy']]))\n")
    out = _nemo_python(nemo_root, code, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    recipe, policy = json.loads(out.stdout.splitlines()[-1])
    assert Fp8Recipe.from_dict(recipe) == Fp8Recipe()  # use_deep_gemm: true in that YAML: auto (DeepGEMM FProp, DGrad)
    assert policy["megatron_cfg"]["fp8_cfg"]["enabled"] is False
    assert policy["generation"]["vllm_cfg"]["precision"] == "bfloat16"
    assert policy["generation"]["vllm_kwargs"]["quantization"] == "jetrl_fp8"
    assert check_policy(policy, tiny.num_layers) == Fp8Recipe()


# ------------------------------------------------------------------------------------------------ the patch
def test_patch_applies_to_v070(nemo_root):
    if shutil.which("git") is None:
        pytest.skip("git is not installed (git apply --check)")
    out = subprocess.run(["git", "apply", "--check", "-v", str(PATCH)], cwd=nemo_root, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr


def _applied(nemo_root: Path, tmp_path: Path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed (git apply)")
    root = tmp_path / "patched"
    for rel in ("nemo_rl/models/policy/utils.py", "nemo_rl/distributed/ray_actor_environment_registry.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(nemo_root / rel, root / rel)
    out = subprocess.run(["git", "apply", str(PATCH)], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return root


def test_patched_resolve_takes_policy_worker_cls(nemo_root, tmp_path):
    root = _applied(nemo_root, tmp_path)
    path = "nemo_rl/models/policy/utils.py"
    tree = ast.parse((root / path).read_text(encoding="utf-8"))
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "resolve_policy_worker_cls"]
    assert contract.check_source(root, _touches(path)[-1:]) == []  # the signature the driver relies on is kept
    ns: dict = {"POLICY_WORKER_OVERRIDES": {MEGATRON_WORKER_FQN: "modelopt.Quant"}}
    exec(compile(ast.Module([fn], []), path, "exec"), ns)  # noqa: S102 - NeMo-RL's patched function, alone
    resolve = ns["resolve_policy_worker_cls"]
    assert resolve(MEGATRON_WORKER_FQN, {"worker_cls": WORKER_FQN}) == WORKER_FQN
    assert resolve(MEGATRON_WORKER_FQN, {}) == MEGATRON_WORKER_FQN  # unchanged without the key
    assert resolve(MEGATRON_WORKER_FQN, {"quant_cfg": {}}) == "modelopt.Quant"


def test_patched_registry_reads_the_entry_points(nemo_root, tmp_path, monkeypatch):
    root = _applied(nemo_root, tmp_path)
    execs = types.SimpleNamespace(SYSTEM="system", VLLM="vllm", SGLANG="sglang", MCORE="mcore", FSDP="fsdp",
                                  AUTOMODEL="automodel", NEMO_GYM="gym")
    monkeypatch.setitem(sys.modules, "nemo_rl.distributed.virtual_cluster",
                        types.SimpleNamespace(PY_EXECUTABLES=execs))
    monkeypatch.setitem(sys.modules, "nemo_rl.modelopt.registry", types.SimpleNamespace(MODELOPT_ACTOR_REGISTRY={}))

    # the real entry point this package installs (pyproject.toml), read by the patched module through importlib
    (entry,) = [e for e in importlib.metadata.entry_points(group="nemo_rl.actor_environments")
                if e.value.startswith("jetrl_megatron.")]
    assert entry.load() is ACTOR_ENVIRONMENTS
    spec = importlib.util.spec_from_file_location("patched_registry",
                                                  root / "nemo_rl/distributed/ray_actor_environment_registry.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.get_actor_python_env(WORKER_FQN) == module.get_actor_python_env(MEGATRON_WORKER_FQN) == "mcore"


# ------------------------------------------------------------------------------------------------ the driver's hooks
def test_driver_registers_and_selects_the_worker():
    from jetrl_megatron.nemo_rl.registry import register_actor_environments
    from jetrl_megatron.nemo_rl.run_grpo import select_jetrl_worker

    registry = {MEGATRON_WORKER_FQN: "uv run --extra mcore"}
    assert register_actor_environments(registry) == [WORKER_FQN]
    assert registry[WORKER_FQN] == "uv run --extra mcore"
    with pytest.raises(KeyError, match="MegatronPolicyWorker"):
        register_actor_environments({})

    lm_policy = types.SimpleNamespace(resolve_policy_worker_cls=lambda default, config: default + "!")
    select_jetrl_worker(lm_policy)
    select_jetrl_worker(lm_policy)  # idempotent
    assert lm_policy.resolve_policy_worker_cls(MEGATRON_WORKER_FQN, {}) == WORKER_FQN
    other = "nemo_rl.models.policy.workers.dtensor_policy_worker.DTensorPolicyWorker"
    assert lm_policy.resolve_policy_worker_cls(other, {}) == other + "!"


def test_nemo_rl_registry_import(nemo_root):
    """With Ray installed, NeMo-RL's own registry module takes the Jet-RL actor."""
    pytest.importorskip("ray", reason="NeMo-RL's registry module imports ray (the `dev` extra installs it)")
    code = ("from nemo_rl.distributed import ray_actor_environment_registry as r; "
            "from jetrl_megatron.nemo_rl.registry import register_actor_environments, WORKER_FQN; "
            "register_actor_environments(r.ACTOR_ENVIRONMENT_REGISTRY); print(r.get_actor_python_env(WORKER_FQN)); "
            f"print(r.get_actor_python_env({MEGATRON_WORKER_FQN!r}))")
    ours, megatron = _nemo_output_lines(nemo_root, code, nemo_root)[-2:]
    assert ours == megatron and "mcore" in megatron, (ours, megatron)


# ------------------------------------------------------------------------------------------------ check_policy
def _policy(recipe: Fp8Recipe | None = None, num_layers: int = 4) -> dict:
    return policy_config(recipe, num_layers)


def _set(tree: dict, dotted: str, value) -> dict:
    tree = copy.deepcopy(tree)
    node = tree
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node[p]
    if value is _DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return tree


_DELETE = object()
QC = "generation.vllm_kwargs.hf_overrides.quantization_config"


def test_check_policy_accepts_and_returns_the_recipe():
    recipe = Fp8Recipe(bf16_last_layers=1, scale_fmt="pow2")
    assert check_policy(_policy(recipe), 4) == recipe
    from jetrl_megatron.nemo_rl.policy_cfg import policy_plan, uses_jetrl

    plan = policy_plan(_policy(recipe), get_model_shape("tiny"))
    assert plan.recipe == recipe and plan.shape.num_layers == 4 and plan.sequence_parallel is False
    assert uses_jetrl(_policy()) and not uses_jetrl(_set(_policy(), "generation.vllm_kwargs", {}))


@pytest.mark.parametrize(("path", "value", "needle"), [
    ("generation.vllm_cfg.precision", "fp8", "policy.generation.vllm_cfg.precision: 'fp8'"),
    ("megatron_cfg.fp8_cfg.enabled", True, "policy.megatron_cfg.fp8_cfg.enabled: True"),
    ("generation.vllm_kwargs.quantization", "fp8", "policy.generation.vllm_kwargs.quantization: 'fp8'"),
    ("sequence_packing.enabled", True, "policy.sequence_packing.enabled: True"),
    ("megatron_cfg.context_parallel_size", 2, "policy.megatron_cfg.context_parallel_size: 2"),
    ("megatron_cfg.num_layers_in_first_pipeline_stage", 1, "num_layers_in_first_pipeline_stage: 1"),
    ("megatron_cfg.peft.enabled", True, "policy.megatron_cfg.peft.enabled"),
    ("megatron_cfg.use_linear_ce_fusion_loss", True, "use_linear_ce_fusion_loss: True"),
    ("draft.enabled", True, "policy.draft.enabled"),
    ("generation.backend", "megatron", "policy.generation.backend: 'megatron'"),
    ("generation.vllm_cfg.kv_cache_dtype", "fp8_e4m3", "kv_cache_dtype: 'fp8_e4m3'"),
    ("generation.vllm_cfg.num_last_layers_in_bf16", 2, "num_last_layers_in_bf16: 2 disagrees"),
    ("generation.vllm_cfg.pow2_weight_scaling_factors", True, "pow2_weight_scaling_factors: True disagrees"),
    (f"{QC}.jet_rl.mode", "bf16", "jet_rl.mode: 'bf16'"),
    (f"{QC}.jet_rl.scale_fmt", "e8m0", "quantization_config.jet_rl.scale_fmt"),
    (f"{QC}.jet_rl", _DELETE, "quantization_config.jet_rl: missing"),
    (f"{QC}.quant_method", "fp8", "quant_method: 'fp8'"),
    (f"{QC}.weight_block_size", [1, 128], "weight_block_size: [1, 128]"),
    (f"{QC}.ignored_layers", ["lm_head", "model.layers.3.mlp.down_proj"], "ignored_layers: vLLM would keep"),
    ("megatron_cfg.enabled", _DELETE, "policy.megatron_cfg.enabled: missing"),
])
def test_check_policy_refuses_naming_the_key(path, value, needle):
    with pytest.raises(PolicyConfigError) as err:
        check_policy(_set(_policy(), path, value), 4)
    assert needle in str(err.value), str(err.value)


def test_nemo_rls_own_worker_asserts_are_refused_before_start_naming_the_keys():
    """NeMo-RL's worker reads logprob_chunk_size itself (needing defer_fp32_logits) and accepts only an offload
    fraction of 1.0: the preflight refuses what those workers would stop on, with both keys."""
    chunked = _set(_policy(), "logprob_chunk_size", 256)
    with pytest.raises(PolicyConfigError, match=r"policy\.logprob_chunk_size: 256.*defer_fp32_logits: true"):
        check_policy(chunked, 4)
    assert check_policy(_set(chunked, "megatron_cfg.defer_fp32_logits", True), 4) == Fp8Recipe()
    def offload(fraction):
        return _set(_policy(), "megatron_cfg.optimizer", {"optimizer_cpu_offload": True,
                                                          "optimizer_offload_fraction": fraction})

    with pytest.raises(PolicyConfigError, match=r"optimizer_offload_fraction: 0\.8; NeMo-RL's driver supports only"):
        check_policy(offload(0.8), 4)
    assert check_policy(offload(1.0), 4) == Fp8Recipe()


def test_a_recipe_with_bf16_layers_needs_their_ignored_layers():
    policy = _policy(Fp8Recipe())
    policy = _set(policy, f"{QC}.jet_rl.bf16_last_layers", 1)  # the recipe changed, the module list did not
    policy = _set(policy, "generation.vllm_cfg.num_last_layers_in_bf16", 1)
    with pytest.raises(PolicyConfigError, match=r"missing \['model.layers.3.mlp.down_proj'"):
        check_policy(policy, 4)


def test_reading_a_key_outside_the_contract_table_is_refused():
    """Every policy key the integration reads is in READS (so contract.CONFIG_KEYS, checked above, is complete)."""
    from jetrl_megatron.nemo_rl import policy_cfg as nemo_rl_policy_cfg

    with pytest.raises(KeyError, match="READS"):
        nemo_rl_policy_cfg._get(_policy(), "megatron_cfg.tensor_model_parallel_size", 1)
