"""The package's shape: no import cycle, one basename per module, the one-way layering, and doc paths that resolve.

Why static: the import graph is read from the source (``ast``), so a cycle hidden behind import order, or an import
from a layer above, fails here even when today's import order happens to work. The checks are tested on small
made-up graphs and trees too, so each one can be seen to fail.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "jetrl_megatron"
# Modules that import an optional stack at the top, and so import only where it is installed.
NEEDS = {"jetrl_megatron.nemo_rl.worker": "nemo_rl"}
# vllm_cpu and vllm_cuda are twin backends of one interface: ``ops.py`` in each, picked by package.
SHARED_BASENAMES = {"ops.py": {"vllm_cpu/ops.py", "vllm_cuda/ops.py"}}
# Layers from the bottom (docs/architecture.md): a module may import its own layer and those below, never above.
LAYERS = ["errors", "config_key", "warm_process", "recipe", "model", "fp8", "vllm_cpu", "vllm_cuda", "sampling",
          "megatron", "reshard", "rollout", "rl", "nemo_rl", "cli"]
LAYER_OF = {"cli_args": "cli", "reshard_cli": "cli", "slurm": "cli"}


def module_name(path: Path, root: Path = PKG) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def modules(root: Path = PKG) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(body: list[ast.stmt], top_only: bool):
    """Import statements of ``body``: module level (under if/try, not ``if TYPE_CHECKING``), or all of them."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and top_only:
            if not _is_type_checking(node.test):
                yield from _imports(node.body, top_only)
            yield from _imports(node.orelse, top_only)
        elif isinstance(node, ast.Try) and top_only:
            for part in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                yield from _imports(part, top_only)
        elif not top_only:
            yield from _imports([c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)], top_only)


def import_graph(mods: dict[str, Path], top_only: bool = True) -> dict[str, set[str]]:
    """{module: the package modules it imports}; ``from a import b`` names module ``a.b`` when that is a module."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text()).body, top_only):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            deps |= {t for t in targets if t in mods and t != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def duplicate_basenames(root: Path = PKG, allowed: dict[str, set[str]] | None = None) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for p in sorted(root.rglob("*.py")):
        if p.name != "__init__.py":
            seen.setdefault(p.name, []).append(str(p.relative_to(root)))
    allowed = allowed or {}
    return {k: v for k, v in seen.items() if len(v) > 1 and set(v) != allowed.get(k)}


def layer(module: str) -> str:
    top = module.split(".")[1] if "." in module else "cli"
    return LAYER_OF.get(top, top)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {name: i for i, name in enumerate(LAYERS)}
    return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                  if a.count(".") and b.count(".") and rank[layer(b)] > rank[layer(a)])


# doc references: `rl/loop.py`, `jetrl_megatron/rl/loop.py`, `tests/test_x.py`, `docs/config.md`, and dotted
# `jetrl_megatron.rl.loop.run` in backticks
PATH_REF = re.compile(r"`([\w./-]+\.(?:py|md|yaml|toml|txt|sh|sbatch|patch))(?::\d+)?`")
DOTTED_REF = re.compile(r"`(jetrl_megatron(?:\.\w+)+)")
# `python -m jetrl_megatron.a.b` in a doc, a Makefile, a script or a message: it must name a module one can run
RUN_REF = re.compile(r"-m (jetrl_megatron(?:\.\w+)*)")


# Files of NeMo-RL, vLLM and Megatron-Core the docs name without their folders.
UPSTREAM_FILES = {"param_and_grad_buffer.py", "setup.py"}


def unresolved_doc_paths(doc: Path, root: Path = ROOT) -> list[str]:
    """This project's path-like references in ``doc`` that name no file. A path whose first folder is one of the
    repo's or the package's is tried from the repo root, the package, ``docs/`` and the doc's folder (a
    ``nemo_rl/a/b.py`` deeper than the package's flat ``nemo_rl/`` is NeMo-RL's own tree); a bare ``name.py`` must be
    some file's name here or one of `UPSTREAM_FILES`. Placeholders (``*``, ``<name>``) are no reference."""
    pkg = root / "jetrl_megatron"
    ours = {p.name for p in root.iterdir() if p.is_dir()} | {p.name for p in pkg.iterdir() if p.is_dir()}
    names = {p.name for p in root.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts}
    bad = []
    for ref in sorted(set(PATH_REF.findall(doc.read_text()))):
        if any(c in ref for c in "*<>{}") or ref.startswith(("/", "~", "$", ".")):
            continue
        parts = ref.split("/")
        if len(parts) == 1:
            if ref.endswith(".py") and ref not in names | UPSTREAM_FILES:
                bad.append(ref)
            continue
        if parts[0] not in ours or (parts[0] == "nemo_rl" and len(parts) > 2):
            continue
        if not any((b / ref).exists() for b in (root, pkg, root / "docs", doc.parent)):
            bad.append(ref)
    return bad


def top_names(path: Path) -> set[str]:
    """Names a module defines or imports at module level."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def unresolved_dotted(doc: Path, mods: dict[str, Path]) -> list[str]:
    """``jetrl_megatron.a.b[.attr]`` references that name no module, or a name its longest module prefix lacks."""
    bad = []
    for ref in sorted(set(DOTTED_REF.findall(doc.read_text()))):
        parts = ref.split(".")
        n = next((n for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in mods), 0)
        if n == 0 or (n < len(parts) and parts[n] not in top_names(mods[".".join(parts[:n])])):
            bad.append(ref)
    return bad


def unrunnable_modules(path: Path, root: Path = PKG) -> list[str]:
    """``-m jetrl_megatron.x.y`` in ``path`` where ``jetrl_megatron/x/y.py`` (or its ``__main__.py``) does not exist."""
    bad = []
    for ref in sorted(set(RUN_REF.findall(path.read_text()))):
        rel = Path(*ref.split(".")[1:]) if "." in ref else Path()
        if not ((root / rel).with_suffix(".py").is_file() or (root / rel / "__main__.py").is_file()):
            bad.append(ref)
    return bad


def command_texts() -> list[Path]:
    """Where users and scripts find commands: the docs, bench results, the Makefile, the SLURM template, the
    scripts, recipes and the package's own messages (run logs under bench/ are history, not instructions)."""
    globs = ("slurm/*", "bench/*.sh", "tools/*.sh", "recipes/**/*.yaml", "patches/*.md", "jetrl_megatron/**/*.py")
    return [*docs(), ROOT / "bench" / "RESULTS.md", ROOT / "Makefile",
            *sorted(p for g in globs for p in ROOT.glob(g) if p.is_file())]


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# ------------------------------------------------------------------------------------------------ the checks


def test_every_module_imports():
    failed = {}
    for name in modules():
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if NEEDS.get(name) != (e.name or "").split(".")[0]:
                failed[name] = repr(e)
        except Exception as e:  # noqa: BLE001 - the report names every module that fails, with its error
            failed[name] = repr(e)
    assert not failed, failed


def test_no_import_cycle():
    graph = import_graph(modules())
    assert len(graph) > 100 and sum(map(len, graph.values())) > 200  # the graph was read, not empty
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_one_basename_per_module():
    assert duplicate_basenames(allowed=SHARED_BASENAMES) == {}


def test_layers_import_downward_only():
    """Module-level and function-level imports alike: a lazy import from a layer above is still an upward edge."""
    assert upward_imports(import_graph(modules(), top_only=False)) == []



# Test files are named by the layer they test (``test_<layer>_*.py``); these few test the project as a whole.
PROJECT_TESTS = {"test_own_process.py", "test_packaging.py", "test_package_layout.py"}


def misnamed_tests(names: list[str], layers: list[str] = LAYERS) -> list[str]:
    """Test files whose name starts with no layer (longest layer first: ``nemo_rl`` before ``rl``)."""
    ordered = sorted({*layers, *LAYER_OF}, key=len, reverse=True)
    return [n for n in names if n not in PROJECT_TESTS
            and not any(n == f"test_{layer}.py" or n.startswith((f"test_{layer}_", f"test_{layer}s"))
                        for layer in ordered)]


def test_test_files_are_named_by_layer():
    names = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    assert len(names) > 50 and misnamed_tests(names) == []
    assert misnamed_tests(["test_backends_cpu.py", "test_fp8_quant.py", "test_rlx.py"]) == ["test_backends_cpu.py",
                                                                                             "test_rlx.py"]


@pytest.mark.parametrize("doc", docs(), ids=lambda p: p.name)
def test_doc_paths_resolve(doc):
    mods = modules()
    assert unresolved_doc_paths(doc) == [] and unresolved_dotted(doc, mods) == []


def test_every_python_dash_m_names_a_runnable_module():
    texts = command_texts()
    assert sum(bool(RUN_REF.search(p.read_text())) for p in texts) >= 8  # the references were found, not none
    assert {str(p.relative_to(ROOT)): unrunnable_modules(p) for p in texts if unrunnable_modules(p)} == {}


# ------------------------------------------------------------------------------- the checks catch what they should


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / "jetrl_megatron" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path / "jetrl_megatron"


def test_checks_catch_a_cycle_a_twin_name_and_an_upward_import(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "", "rl/__init__.py": "", "rl/a.py": "from jetrl_megatron.rl import b\n",
        "rl/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jetrl_megatron.rl import c\n"
                   "from .c import x\n",
        "rl/c.py": "import jetrl_megatron.rl.a\nx = 1\n",
        "fp8/__init__.py": "", "fp8/c.py": "def f():\n    from jetrl_megatron.rl.a import y\n",
    })
    mods = modules(root)
    graph = import_graph(mods)
    assert graph["jetrl_megatron.rl.b"] == {"jetrl_megatron.rl.c"}  # the relative import; TYPE_CHECKING skipped
    assert find_cycle(graph) == ["jetrl_megatron.rl.a", "jetrl_megatron.rl.b", "jetrl_megatron.rl.c",
                                 "jetrl_megatron.rl.a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert duplicate_basenames(root) == {"c.py": ["fp8/c.py", "rl/c.py"]}
    assert duplicate_basenames(root, {"c.py": {"fp8/c.py", "rl/c.py"}}) == {}
    assert upward_imports(graph) == []  # the fp8 -> rl import is inside a function
    assert upward_imports(import_graph(mods, top_only=False)) == ["jetrl_megatron.fp8.c -> jetrl_megatron.rl.a"]


def test_run_check_catches_a_module_that_is_not_there(tmp_path):
    pkg = tmp_path / "jetrl_megatron"
    (pkg / "rl" / "tools").mkdir(parents=True)
    (pkg / "cli.py").write_text("")
    (pkg / "rl" / "tools" / "dose_response.py").write_text("")
    (pkg / "rl" / "tools" / "__main__.py").write_text("")
    doc = tmp_path / "x.md"
    doc.write_text("python -m jetrl_megatron.cli run; `python3 -m jetrl_megatron.rl.tools.dose_response d`\n"
                   "    python -m jetrl_megatron.rl.dose_response d; python -m jetrl_megatron.rl.tools\n"
                   "-m jetrl_megatron\n")
    assert unrunnable_modules(doc, pkg) == ["jetrl_megatron", "jetrl_megatron.rl.dose_response"]


def test_doc_check_catches_a_stale_path(tmp_path):
    (tmp_path / "jetrl_megatron" / "rl").mkdir(parents=True)
    (tmp_path / "jetrl_megatron" / "rl" / "loop.py").write_text("")
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "x.md"
    doc.write_text("`rl/loop.py`, `jetrl_megatron/rl/loop.py:12`, `rl/plan.py`, `runs/<name>/x.py`, `x.md`\n"
                   "`loop.py`, `plan.py`, `setup.py`, `vllm/v1/worker.py`, `nemo_rl/models/policy.py`\n"
                   "`jetrl_megatron.rl.loop.run`, `jetrl_megatron.rl.plan.plan_report`\n")
    assert unresolved_doc_paths(doc, tmp_path) == ["plan.py", "rl/plan.py"]
    (tmp_path / "jetrl_megatron" / "rl" / "loop.py").write_text("import os\n\n\ndef run():\n    pass\n")
    (tmp_path / "jetrl_megatron" / "rl" / "__init__.py").write_text("")
    mods = modules(tmp_path / "jetrl_megatron")
    assert unresolved_dotted(doc, mods) == ["jetrl_megatron.rl.plan.plan_report"]  # the package has no `plan`
