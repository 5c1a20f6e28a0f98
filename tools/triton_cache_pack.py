"""Pack Triton's kernel cache small enough to carry between GPU sessions: each kernel's binary and metadata only.

Why: a GPU session's first GRPO step recompiles every Triton kernel it runs (the 8B run's first update took 83 s,
its second 21 s), and a device call brings back at most 16 MiB per file, which the whole cache exceeded. Triton
needs only a kernel's binary (``.cubin``) and its metadata (``.json``) to load it, and the host launchers it compiled
(``.so``, one per signature, also seconds each); the intermediate IR files (``.ttir``, ``.ttgir``, ``.llir``,
``.ptx``, ...) are kept only for inspection. Triton's loader refuses a group whose
listed files are missing, so each group file (``__grp__*.json``) is rewritten to list the kept files only. The live
cache is not touched: the pruned copy is written to a temporary folder and packed from there (tar + xz).

    python3 tools/triton_cache_pack.py /tmp/triton_cache $OUT/triton_cache.tar.xz [--max-mib 12]

Unpack with ``tar xf triton_cache.tar.xz -C /tmp`` (the cache's own paths are absolute: unpack where it was).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

KEEP_SUFFIXES = (".json", ".cubin")


def prune_copy(cache: Path, dest: Path) -> tuple[int, int]:
    """Copy ``cache``'s kernels into ``dest`` (same layout) with only the files Triton needs to load them, their group
    files rewritten to point at the copies' final location (``cache``'s own paths). (kernels, bytes kept)."""
    kernels, kept = 0, 0
    for grp in sorted(cache.glob("*/__grp__*.json")):
        try:
            children = json.loads(grp.read_text())["child_paths"]
        except (OSError, ValueError, KeyError):
            continue  # a corrupt or foreign entry: Triton would recompile it anyway
        keep = {name: path for name, path in children.items() if name.endswith(KEEP_SUFFIXES) and Path(path).exists()}
        if not any(name.endswith(".cubin") for name in keep):
            continue  # not a CUDA kernel Triton can load from a binary
        out_dir = dest / grp.parent.name
        out_dir.mkdir(parents=True, exist_ok=True)
        for path in keep.values():
            shutil.copy2(path, out_dir / Path(path).name)
            kept += Path(path).stat().st_size
        (out_dir / grp.name).write_text(json.dumps({"child_paths": keep}))
        kernels += 1
    for so in sorted(cache.glob("*/*.so")):  # the compiled launchers / driver utils Triton builds per signature
        if not any(so.parent.glob("__grp__*")):
            (dest / so.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copy2(so, dest / so.parent.name / so.name)
            kept += so.stat().st_size
    return kernels, kept


def pack(cache: Path, out: Path, max_mib: float) -> bool:
    """Write ``out`` (tar.xz of the pruned cache, rooted at ``cache``'s name); False (and no file) when it would be
    over ``max_mib``."""
    # written beside ``out`` and renamed when whole: a device call cut while packing (its time limit) must not leave
    # a truncated archive that the next session carries and fails to unpack (found 2026-12-06)
    partial = out.with_name(out.name + ".partial")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / cache.name
        root.mkdir()  # an empty cache packs as an empty folder
        kernels, kept = prune_copy(cache, root)
        try:
            with tarfile.open(partial, "w:xz") as tar:
                tar.add(root, arcname=cache.name)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    os.replace(partial, out)
    size = out.stat().st_size
    print(f"{out}: {kernels} kernels, {kept / 2**20:.1f} MiB of binaries and metadata, {size / 2**20:.1f} MiB packed")
    if size > max_mib * 2**20:
        out.unlink()
        print(f"over {max_mib:g} MiB: not kept")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cache", type=Path, help="Triton's cache folder (TRITON_CACHE_DIR)")
    p.add_argument("out", type=Path, help="the .tar.xz to write")
    p.add_argument("--max-mib", type=float, default=12.0, help="drop the pack when it is larger (default 12)")
    args = p.parse_args(argv)
    if not args.cache.is_dir():
        p.error(f"{args.cache}: no such folder")
    return 0 if pack(args.cache, args.out, args.max_mib) else 1


if __name__ == "__main__":
    sys.exit(main())
