"""tools/triton_cache_pack.py: a Triton cache pruned to binaries and metadata still serves its kernels.

CPU: a kernel of ours compiled for sm_90 (Triton's CUDA compiler needs no GPU; ptxas ships with Triton) fills a
cache; the pack keeps its ``.cubin`` and ``.json`` files only, and after the cache is replaced by the unpacked pack a
second compile is a cache hit (its kernel has no PTX: it was loaded, not rebuilt), with the same binary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

COMPILE = r"""
import sys, hashlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from jetrl_megatron.megatron import triton_numerics as tn
sig = {"X": "*bf16", "Y": "*bf16", "Q": "*fp8e4nv", "QS": "*fp32", "n_rows": "i32", "F": "i32", "stride_x": "i32",
       "stride_y": "i32", "stride_qs": "i32", "amax_eps": "fp32", "BLOCK_M": "constexpr", "BLOCK_F": "constexpr",
       "EMU_BF16": "constexpr", "QUANT": "constexpr", "POW2": "constexpr", "CAST": "constexpr"}
const = {"BLOCK_M": 4, "BLOCK_F": 256, "EMU_BF16": False, "QUANT": True, "POW2": False, "CAST": True}
k = triton.compile(ASTSource(fn=tn._swiglu_fwd_kernel, signature=sig, constexprs=const),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **tn._launch_opts()})
print("ASM", ",".join(sorted(k.asm.keys())), hashlib.sha256(k.asm["cubin"]).hexdigest())
"""


def _compile(cache: Path) -> tuple[set[str], str]:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ASM ")), None)
    if line is None:
        if "ptxas" in proc.stderr or "GPUTarget" in proc.stderr or "ImportError" in proc.stderr:
            pytest.skip(f"this triton cannot compile for CUDA here: {proc.stderr[-500:]}")
        raise AssertionError(proc.stderr[-3000:])
    _, kinds, digest = line.split()
    return set(kinds.split(",")), digest


def test_pruned_cache_serves_the_kernel_without_a_rebuild(tmp_path):
    pytest.importorskip("triton")
    sys.path.insert(0, str(ROOT / "tools"))
    import triton_cache_pack

    cache = tmp_path / "triton_cache"
    kinds, digest = _compile(cache)
    launcher = cache / "0123abcd" / "__triton_launcher.so"  # stands for a host launcher Triton built (GPU only)
    launcher.parent.mkdir()
    launcher.write_bytes(b"\x7fELF launcher")
    assert {"cubin", "ptx"} <= kinds, kinds  # compiled: every stage's IR
    out = tmp_path / "pack.tar.xz"
    assert triton_cache_pack.main([str(cache), str(out)]) == 0
    with tarfile.open(out) as tar:
        names = tar.getnames()
        assert any(n.endswith(".cubin") for n in names) and not any(n.endswith((".ptx", ".ttgir")) for n in names)
        assert "triton_cache/0123abcd/__triton_launcher.so" in names
        cache.rename(tmp_path / "live_cache_moved")  # the pack stands alone
        tar.extractall(tmp_path, filter="data")
    kinds2, digest2 = _compile(cache)
    assert kinds2 == {"cubin"} and digest2 == digest, kinds2  # loaded from the pack, the same binary
    assert triton_cache_pack.main([str(cache), str(tmp_path / "tiny.tar.xz"), "--max-mib", "0.000001"]) == 1
    assert not (tmp_path / "tiny.tar.xz").exists()


def test_a_pack_cut_midway_leaves_no_archive_behind(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import triton_cache_pack as tcp
    finally:
        sys.path.remove(str(ROOT / "tools"))
    cache = tmp_path / "triton_cache" / "abc123"
    cache.mkdir(parents=True)
    (cache / "k.json").write_text('{"name": "k"}')
    (cache / "k.cubin").write_bytes(os.urandom(4096))
    (cache / "k.ptx").write_text("// dropped by the pack")
    (cache / "__grp__k.json").write_text(json.dumps({"child_paths": {
        n: str(cache / n) for n in ("k.json", "k.cubin", "k.ptx")}}))
    out = tmp_path / "triton_cache.tar.xz"
    out.write_bytes(b"the previous whole pack")

    def cut(self, *args, **kwargs):  # the device call's time limit arriving while the archive is written
        raise KeyboardInterrupt

    monkeypatch.setattr(tarfile.TarFile, "add", cut)
    with pytest.raises(KeyboardInterrupt):
        tcp.pack(cache.parent, out, max_mib=10)
    # the earlier archive is untouched and no partial one is left to be carried
    assert out.read_bytes() == b"the previous whole pack" and not list(tmp_path.glob("*.partial"))
    monkeypatch.undo()
    assert tcp.pack(cache.parent, out, max_mib=10)
    with tarfile.open(out) as tar:
        assert sorted(m.name for m in tar.getmembers() if m.isfile()) == [
            "triton_cache/abc123/__grp__k.json", "triton_cache/abc123/k.cubin", "triton_cache/abc123/k.json"]
