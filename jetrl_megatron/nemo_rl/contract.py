"""Everything the Jet-RL integration relies on in NeMo-RL v0.7.0, as one table, and a checker that reads NeMo-RL's
source with ``ast`` (nothing of NeMo-RL is imported, so it runs wherever its source tree is).

Why a table: the glue (``worker.py``, ``registry.py``, ``run_grpo.py``) is thin, and its correctness rests on
NeMo-RL's internals — which methods the refit calls, where the model is built, how the actor registry is read. The
table says exactly which; the tests check that the glue touches nothing outside it and that every entry holds at
v0.7.0 (``python -m jetrl_megatron.nemo_rl.contract <nemo-rl checkout>`` checks another version). The policy config
keys come from :data:`jetrl_megatron.nemo_rl.policy_cfg.READS`, the one list of keys that module reads.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

from jetrl_megatron.nemo_rl.policy_cfg import READS
from jetrl_megatron.nemo_rl.registry import MEGATRON_WORKER_FQN

__all__ = ["NEMO_RL_VERSION", "Touch", "TOUCHES", "CONFIG_KEYS", "check_source", "params_of", "main"]

NEMO_RL_VERSION = "0.7.0"

MPW = "nemo_rl/models/policy/workers/megatron_policy_worker.py"
SETUP = "nemo_rl/models/megatron/setup.py"
MCONFIG = "nemo_rl/models/megatron/config.py"
PUTILS = "nemo_rl/models/policy/utils.py"
LM_POLICY = "nemo_rl/models/policy/lm_policy.py"
REGISTRY = "nemo_rl/distributed/ray_actor_environment_registry.py"
WORKER_GROUPS = "nemo_rl/distributed/worker_groups.py"
UCONFIG = "nemo_rl/utils/config.py"
VLLM_WORKER = "nemo_rl/models/generation/vllm/vllm_worker.py"
VLLM_BACKEND = "nemo_rl/models/generation/vllm/vllm_backend.py"
VLLM_FP8 = "nemo_rl/models/generation/vllm/quantization/fp8.py"
RUN_GRPO = "examples/run_grpo.py"
GEN_INIT = "nemo_rl/models/generation/__init__.py"


@dataclass(frozen=True)
class Touch:
    """One thing in NeMo-RL's source and what must hold for it.

    ``name``: dotted inside the module (``Class.method``, ``function``, ``NAME``). ``params``: the exact parameter
    list (``*`` starts keyword-only ones, ``*args`` / ``**kwargs`` as written). ``calls``: dotted callees that occur
    in it; ``assigns``: dotted targets assigned in it; ``mentions``: dotted names or string literals that occur in it;
    ``decorators``: dotted decorator names; ``imported_from``: the name is imported into the module from there.
    ``override``: the Jet-RL worker class overrides this method.
    """

    path: str
    name: str
    why: str
    params: tuple[str, ...] | None = None
    calls: tuple[str, ...] = ()
    assigns: tuple[str, ...] = ()
    mentions: tuple[str, ...] = ()
    decorators: tuple[str, ...] = ()
    imported_from: str | None = None
    override: bool = False


_INIT_PARAMS = ("self", "config", "tokenizer", "weights_path", "optimizer_path", "init_optimizer",
                "init_reference_model", "*", "worker_sharding_annotations", "**kwargs")

TOUCHES: tuple[Touch, ...] = (
    # ---------------------------------------------------------------- the policy worker (worker.py)
    Touch(MPW, "MegatronPolicyWorkerImpl", "subclassed by JetRLMegatronPolicyWorkerImpl"),
    Touch(MPW, "MegatronPolicyWorkerImpl.__init__", "overridden: checks the config, then forwards everything; the "
          "model build is looked up in this module's globals when __init__ runs", params=_INIT_PARAMS,
          calls=("setup_model_and_optimizer", "setup_reference_model_state"), assigns=("self.model",),
          override=True),
    Touch(MPW, "setup_model_and_optimizer", "wrapped in this module's namespace: the provider builds Jet-RL chunks, "
          "then the FP8 cache is refreshed and hooked to the optimizer step",
          imported_from="nemo_rl.models.megatron.setup"),
    Touch(MPW, "setup_reference_model_state", "wrapped likewise: the reference policy is built by the same provider",
          imported_from="nemo_rl.models.megatron.setup"),
    Touch(MPW, "MegatronPolicyWorkerImpl._iter_params_with_optional_kv_scales", "overridden: the refit generator "
          "(HF names, full tensors; FP8 cache bytes + scales)", params=("self", "kv_scales"), override=True),
    Touch(MPW, "MegatronPolicyWorkerImpl._calculate_refit_param_info", "overridden: sizes from the Jet-RL stream, "
          "no Megatron-Bridge conversion tasks", params=("self",), override=True),
    Touch(MPW, "MegatronPolicyWorkerImpl.use_reference_model", "overridden: the FP8 cache is re-quantized after "
          "the reference weights are copied in, and after the policy's come back", params=("self",),
          decorators=("contextmanager",), calls=("self._apply_state_dict_to_model",), override=True),
    Touch(MPW, "MegatronPolicyWorkerImpl.train", "overridden: runs NeMo-RL's train() with autograd's backward on "
          "the calling thread (policy.jet_rl.backward_thread); the backward happens inside it",
          params=("self", "data", "loss_fn", "eval_mode", "gbs", "mbs", "check_dim_skip_keys"),
          calls=("megatron_forward_backward",), override=True),
    Touch(MPW, "MegatronPolicyWorkerImpl.prepare_refit_info", "the refit metadata comes from the overridden methods",
          params=("self",), calls=("self._calculate_refit_param_info", "self._iter_params_with_optional_kv_scales")),
    Touch(MPW, "MegatronPolicyWorkerImpl.stream_weights_via_ipc_zmq", "colocated refit consumes the generator",
          params=("self", "buffer_size_bytes", "kv_scales"), calls=("self._iter_params_with_optional_kv_scales",)),
    Touch(MPW, "MegatronPolicyWorkerImpl.broadcast_weights_for_collective", "non-colocated refit consumes the "
          "generator", params=("self", "kv_scales"), calls=("self._iter_params_with_optional_kv_scales",)),
    Touch(MPW, "MegatronPolicyWorkerImpl.train", "the optimizer step the FP8 refresh is attached to",
          calls=("self.optimizer.step",)),
    Touch(MPW, "MegatronPolicyWorker", "the Ray actor form the Jet-RL actor mirrors (same runtime env name)",
          decorators=("ray.remote",), calls=("get_runtime_env_for_policy_worker",),
          mentions=("megatron_policy_worker",)),
    Touch(PUTILS, "get_runtime_env_for_policy_worker", "the Jet-RL actor's runtime env",
          params=("policy_worker_name",)),
    Touch(SETUP, "setup_model_and_optimizer", "called as (policy_cfg, megatron_cfg, ...); megatron_cfg.model is the "
          "provider whose provide() builds the chunks", params=(
              "policy_cfg", "megatron_cfg", "load_optimizer", "get_embedding_ranks", "get_position_embedding_ranks",
              "pre_load_checkpoint_hook", "additional_pre_wrap_hooks"),
          calls=("get_model", "load_checkpoint", "ModelAndOptimizerState"), mentions=("megatron_cfg.model",)),
    Touch(SETUP, "get_model", "Megatron-Bridge's get_model calls provider.provide(pre_process, post_process)",
          imported_from="megatron.bridge.models.model_provider"),
    Touch(SETUP, "setup_reference_model_state", "called as (config, megatron_cfg, ...); the reference model is "
          "built by the same provider", params=("config", "megatron_cfg", "pretrained_path",
                                               "pre_load_checkpoint_hook"),
          calls=("get_model",), mentions=("megatron_cfg.model",)),
    Touch(MCONFIG, "ModelAndOptimizerState", "the wrapper reads .model and .optimizer of the result",
          assigns=("model", "optimizer")),
    Touch(PUTILS, "stream_weights_via_ipc_zmq_impl", "consumes (name, tensor) pairs as raw bytes (FP8 kept)",
          params=("params_generator", "buffer_size_bytes", "zmq_socket", "rank", "worker_name"),
          mentions=("torch.uint8",)),
    # ---------------------------------------------------------------- worker selection (registry.py, run_grpo.py)
    Touch(REGISTRY, "ACTOR_ENVIRONMENT_REGISTRY", "the Jet-RL actor gets the Megatron worker's environment",
          mentions=(MEGATRON_WORKER_FQN,)),
    Touch(REGISTRY, "get_actor_python_env", "reads the registry dict at call time", params=("actor_class_fqn",),
          mentions=("ACTOR_ENVIRONMENT_REGISTRY",)),
    Touch(WORKER_GROUPS, "get_actor_python_env", "looked up in the driver process when the workers are created",
          imported_from="nemo_rl.distributed.ray_actor_environment_registry"),
    Touch(WORKER_GROUPS, "RayWorkerGroup._create_workers_from_bundle_indices", "the registry lookup by class name",
          calls=("get_actor_python_env",)),
    Touch(WORKER_GROUPS, "RayWorkerBuilder.IsolatedWorkerInitializer.create_worker", "imports the actor class by "
          "its dotted name in the worker's environment", calls=("importlib.import_module",)),
    Touch(LM_POLICY, "resolve_policy_worker_cls", "wrapped in lm_policy's namespace by the driver",
          imported_from="nemo_rl.models.policy.utils"),
    Touch(LM_POLICY, "Policy.__init__", "asks resolve_policy_worker_cls for the Megatron worker's class name",
          calls=("resolve_policy_worker_cls", "RayWorkerBuilder"), mentions=(MEGATRON_WORKER_FQN,)),
    Touch(PUTILS, "resolve_policy_worker_cls", "called as (default_cls, config)", params=("default_cls", "config")),
    Touch(UCONFIG, "load_config", "the driver's preflight loads the YAML as run_grpo.py does",
          params=("config_path",)),
    Touch(UCONFIG, "parse_hydra_overrides", "the driver's preflight applies the overrides",
          params=("cfg", "overrides")),
    Touch(UCONFIG, "register_omegaconf_resolvers", "idempotent (run_grpo.py registers again)", params=(),
          mentions=("OmegaConf.has_resolver",)),
    Touch(RUN_GRPO, "main", "run unchanged by the driver", params=(),
          calls=("parse_args", "load_config", "parse_hydra_overrides", "setup")),
    Touch(RUN_GRPO, "parse_args", "takes --config and passes the rest as overrides", mentions=("--config",),
          calls=("parser.parse_known_args",)),
    # ---------------------------------------------------------------- the vLLM side (configuration only)
    Touch(VLLM_WORKER, "BaseVllmGenerationWorker._load_model", "policy.generation.vllm_kwargs (quantization, "
          "hf_overrides) go to vllm.LLM; precision 'fp8' would call init_fp8",
          params=("self", "bundle_indices", "seed"), calls=("self._create_engine",),
          mentions=("vllm_kwargs", "hf_overrides", "init_fp8", "fp8")),
    Touch(GEN_INIT, "configure_generation_config", "training engines start with load_format 'dummy': vLLM allocates "
          "the jetrl_fp8 parameters and never reads the BF16 checkpoint into them; the first refit fills them",
          mentions=("load_format", "dummy")),
    Touch(VLLM_FP8, "is_fp8_model", "False for the jetrl_fp8 config (not an Fp8Config): refit goes through "
          "model.load_weights unchanged", params=("vllm_config",), mentions=("Fp8Config",)),
    Touch(VLLM_BACKEND, "VllmInternalWorkerExtension._load_weights", "the refit's tensors go to vLLM's own loader",
          params=("self", "weights"), calls=("fp8.is_fp8_model", "self.model_runner.model.load_weights")),
    Touch(VLLM_BACKEND, "VllmInternalWorkerExtension.update_weights_via_ipc_zmq", "then process_weights_after_"
          "loading (a no-op for jetrl_fp8 linears)", params=("self",),
          calls=("self._load_weights", "process_weights_after_loading")),
)

# NeMo-RL config keys the integration reads ("policy.<key>" -> where NeMo-RL has it: "yaml" in its base GRPO YAMLs,
# "code" read by its code with a default, "ours" inside its vllm_kwargs pass-through).
CONFIG_KEYS: dict[str, str] = {f"policy.{k}": where for k, where in READS.items()}
CONFIG_YAML = "examples/configs/grpo_math_1B_megatron.yaml"


# ---------------------------------------------------------------------------------------------------- the checker
def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    return None


def params_of(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    """A function's parameter list as the table writes it."""
    a = fn.args
    out = [p.arg for p in (*a.posonlyargs, *a.args)]
    if a.vararg is not None:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    out += [p.arg for p in a.kwonlyargs]
    if a.kwarg is not None:
        out.append("**" + a.kwarg.arg)
    return tuple(out)


def _find(tree: ast.Module, name: str) -> ast.AST | None:
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in name.split("."):
        node = None
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == part:
                node = stmt
            elif isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == part for t in stmt.targets):
                node = stmt
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == part:
                node = stmt
        if node is None:
            return None
        body = getattr(node, "body", [])
    return node


def _imports(tree: ast.Module, module: str, name: str) -> bool:
    return any(isinstance(s, ast.ImportFrom) and s.module == module and any(a.name == name for a in s.names)
               for s in tree.body)


def _occurring(node: ast.AST) -> tuple[set[str], set[str], set[str]]:
    """(called dotted names, assigned dotted targets, mentioned dotted names and string literals) inside ``node``."""
    calls, assigns, mentions = set(), set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and (d := _dotted(n.func)):
            calls.add(d)
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                for tt in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if d := _dotted(tt):
                        assigns.add(d)
        if isinstance(n, (ast.Name, ast.Attribute)) and (d := _dotted(n)):
            mentions.add(d)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            mentions.add(n.value)
    return calls, assigns, mentions


def check_touch(root: Path, t: Touch, _cache: dict[str, ast.Module] | None = None) -> list[str]:
    """What does not hold for ``t`` in the NeMo-RL tree at ``root`` (empty: it holds)."""
    cache = {} if _cache is None else _cache
    where = f"{t.path}: {t.name}"
    if t.path not in cache:
        file = root / t.path
        if not file.is_file():
            return [f"{t.path}: file not found"]
        cache[t.path] = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    tree = cache[t.path]
    if t.imported_from is not None:
        return [] if _imports(tree, t.imported_from, t.name) else [f"{where}: not imported from {t.imported_from}"]
    node = _find(tree, t.name)
    if node is None:
        return [f"{where}: not found"]
    problems = []
    if t.params is not None:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return [f"{where}: not a function"]
        got = params_of(node)
        if got != t.params:
            problems.append(f"{where}: parameters are {got}, expected {t.params}")
    if t.decorators:
        have = {_dotted(d) for d in getattr(node, "decorator_list", [])}
        problems += [f"{where}: not decorated with @{d}" for d in t.decorators if d not in have]
    calls, assigns, mentions = _occurring(node)
    problems += [f"{where}: does not call {c}" for c in t.calls if c not in calls]
    problems += [f"{where}: does not assign {a}" for a in t.assigns if a not in assigns]
    problems += [f"{where}: does not mention {m!r}" for m in t.mentions if m not in mentions]
    return problems


def check_source(root: str | Path, touches: tuple[Touch, ...] = TOUCHES) -> list[str]:
    """Every problem with ``touches`` in the NeMo-RL source tree at ``root`` (the directory holding ``nemo_rl/``)."""
    root = Path(root)
    cache: dict[str, ast.Module] = {}
    return [p for t in touches for p in check_touch(root, t, cache)]


def main(argv: list[str] | None = None) -> int:
    """``python -m jetrl_megatron.nemo_rl.contract <nemo-rl root>``: exit 0 when every entry holds."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m jetrl_megatron.nemo_rl.contract <NeMo-RL source root>", file=sys.stderr)
        return 2
    problems = check_source(args[0])
    for p in problems:
        print(p)
    print(f"{len(TOUCHES)} entries checked against NeMo-RL v{NEMO_RL_VERSION}'s expectations: "
          f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
