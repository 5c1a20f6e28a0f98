"""The `jetrl_fp8` plugin's registration surface, in fresh interpreters (no engine started here).

- the package and the rollout modules import without pulling in vLLM;
- vLLM's own plugin loader finds `register` through the installed `vllm.general_plugins` entry point and the method
  then resolves by name; `from_config` reads the recipe's quantization_config; registering twice is harmless.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def _run(code: str, timeout: int = 120) -> str:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_rollout_modules_import_without_vllm():
    out = _run("""
        import sys
        import jetrl_megatron, jetrl_megatron.rollout
        import jetrl_megatron.rollout.plugin, jetrl_megatron.rollout.engine
        import jetrl_megatron.rollout.model_dir, jetrl_megatron.rollout.refit
        print("VLLM_LOADED", "vllm" in sys.modules)
    """)
    assert "VLLM_LOADED False" in out


def test_entry_point_discovered_by_vllm_in_fresh_process():
    pytest.importorskip("vllm")
    out = _run("""
        from importlib.metadata import entry_points
        eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
        assert eps.get("jetrl_fp8") == "jetrl_megatron.rollout.plugin:register", eps

        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
        assert "jetrl_fp8" not in QUANTIZATION_METHODS  # nothing of ours imported yet
        from vllm.plugins import load_general_plugins
        load_general_plugins()  # what vLLM runs in its main, engine-core and worker processes
        assert QUANTIZATION_METHODS.count("jetrl_fp8") == 1
        cls = get_quantization_config("jetrl_fp8")
        print("CLASS", cls.__module__, cls.__name__)

        from jetrl_megatron.recipe import Fp8Recipe
        from jetrl_megatron.rollout import plugin
        plugin.register(); plugin.register()
        assert QUANTIZATION_METHODS.count("jetrl_fp8") == 1 and plugin.is_registered()

        qc = Fp8Recipe(scale_fmt="pow2", bf16_first_layers=1).hf_quantization_config(4, quant_method="jetrl_fp8")
        cfg = cls.from_config(qc)
        print("RECIPE", cfg.recipe.scale_fmt, cfg.recipe.bf16_first_layers, len(cfg.ignored_layers))
        std = Fp8Recipe().hf_quantization_config(4)  # a standard block-fp8 config (quant_method "fp8")
        print("STD", cls.from_config(std).recipe == Fp8Recipe())
        for bad in ({"weight_block_size": [64, 64]}, {"activation_scheme": "static"}, {"fmt": "e5m2"}):
            try:
                cls.from_config({**qc, **bad})
            except ValueError as e:
                print("REFUSED", str(e).split(":")[0])
    """)
    assert "CLASS jetrl_megatron.rollout.quant_method JetRLFp8Config" in out
    assert "RECIPE pow2 1 8" in out  # lm_head + layer 0's seven projections
    assert "STD True" in out
    assert out.count("REFUSED jetrl_fp8") == 3
