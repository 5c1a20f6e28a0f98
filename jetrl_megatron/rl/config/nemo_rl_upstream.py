"""NeMo-RL v0.7.0's own GRPO YAMLs, read from its release tarball: the test data of the config loader and the source of
the key table in ``docs/nemo_rl_keys.md`` (``jetrl keys``).

Why from the tarball: the table must list every key those YAMLs carry, and the conformance test must run the loader
on the files a NeMo-RL user has, not on copies that could drift. Nothing here is imported by a run.
"""

from __future__ import annotations

import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jetrl_megatron.rl.config.nemo_rl_keys import IGNORED, IMPLEMENTED, REFUSED, rule_for, schema_status
from jetrl_megatron.rl.config.schema import RunConfigFields, schema_defaults
from jetrl_megatron.rl.config.yaml_tree import leaf_paths, load_tree, resolve_tree

TARBALL_NAME = "nemo-rl-v0.7.0.tar.gz"
CONFIG_DIRS = ("examples/configs", "examples/configs/recipes/llm")


def find_tarball(repo_root: Path) -> Path | None:
    """``$JETRL_NEMO_RL_TARBALL``, else ``shared/upstream/`` beside or inside the checkout."""
    env = os.environ.get("JETRL_NEMO_RL_TARBALL")
    candidates = [Path(env)] if env else []
    candidates += [repo_root.parent / "shared" / "upstream" / TARBALL_NAME, repo_root / "shared" / "upstream" /
                   TARBALL_NAME]
    return next((p for p in candidates if p.is_file()), None)


def unpack(tarball: Path, dest: Path) -> Path:
    """Extract the YAMLs (only) into ``dest``; returns the NeMo-RL root inside it."""
    with tarfile.open(tarball) as tf:
        members = [m for m in tf.getmembers() if m.isfile() and m.name.endswith((".yaml", ".yml"))]
        tf.extractall(dest, members=members, filter="data")
    roots = {Path(m.name).parts[0] for m in members}
    if len(roots) != 1:
        raise ValueError(f"{tarball}: expected one top-level folder, found {sorted(roots)}")
    return dest / roots.pop()


@dataclass
class UpstreamYaml:
    path: Path
    resolved: dict[str, Any]


def megatron_grpo_yamls(root: Path) -> list[UpstreamYaml]:
    """Every GRPO YAML of ``examples/configs`` and ``examples/configs/recipes/llm`` whose resolved config enables
    the Megatron backend (``policy.megatron_cfg.enabled``), sorted by name. ``${oc.env:HF_HOME}`` reads as the
    placeholder ``<HF_HOME>`` (so the table does not depend on this machine)."""
    out = []
    saved = os.environ.get("HF_HOME")
    os.environ["HF_HOME"] = "<HF_HOME>"
    try:
        for d in CONFIG_DIRS:
            for path in sorted((root / d).glob("grpo*.yaml")):
                resolved = resolve_tree(load_tree(path))
                if ((resolved.get("policy") or {}).get("megatron_cfg") or {}).get("enabled"):
                    out.append(UpstreamYaml(path, resolved))
    finally:
        if saved is None:
            os.environ.pop("HF_HOME")
        else:
            os.environ["HF_HOME"] = saved
    return out


def key_values(yamls: list[UpstreamYaml]) -> dict[str, list[Any]]:
    """Every leaf key of the YAMLs and the distinct values it takes (first seen first)."""
    seen: dict[str, list[Any]] = {}
    for y in yamls:
        for k, v in leaf_paths(y.resolved).items():
            vals = seen.setdefault(k, [])
            if all(json.dumps(v, default=str) != json.dumps(x, default=str) for x in vals):
                vals.append(v)
    return dict(sorted(seen.items()))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _short(value: Any, limit: int = 40) -> str:
    s = json.dumps(value, default=str)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def key_status(key: str) -> tuple[str, str]:
    """(status as the table shows it, note) for ``key`` whatever its value."""
    rule = rule_for(key)
    if rule is None:
        return (IMPLEMENTED, "") if schema_status(RunConfigFields, key) is not None else ("unknown", "")
    status = rule.status
    if rule.allowed is not None and rule.status != REFUSED:
        allowed = ", ".join(_short(a) for a in rule.allowed)
        status = f"{rule.status} (accepted: {allowed}); other values refused"
    return status, rule.note


def markdown_table(upstream: dict[str, list[Any]]) -> str:
    """The key table: every key of NeMo-RL v0.7.0's Megatron GRPO YAMLs, then this project's own keys."""
    project = {k for k in leaf_paths(schema_defaults()) if k not in upstream}
    lines = ["| key | status | note | values in NeMo-RL's YAMLs |", "|---|---|---|---|"]
    for key in sorted(upstream):
        status, note = key_status(key)
        values = ", ".join(_short(v) for v in upstream[key][:4]) + (" ..." if len(upstream[key]) > 4 else "")
        lines.append(f"| `{key}` | {status} | {_cell(note)} | {_cell(values)} |")
    lines += ["", "Keys of this project's schema that NeMo-RL v0.7.0's Megatron GRPO YAMLs do not set "
              "(implemented; `policy.jet_rl.*` is this project's block, `data.train.num_*` / `term_digits` are the "
              "synthetic datasets' options):", "", "| key | status |", "|---|---|"]
    lines += [f"| `{k}` | {key_status(k)[0]} |" for k in sorted(project)]
    counts = {s: sum(1 for k in upstream if key_status(k)[0].startswith(s)) for s in (IMPLEMENTED, IGNORED, REFUSED)}
    head = (f"{len(upstream)} keys in NeMo-RL v0.7.0's Megatron GRPO YAMLs: {counts[IMPLEMENTED]} implemented, "
            f"{counts[IGNORED]} ignored (no effect, one warning at start), {counts[REFUSED]} refused whatever the "
            "value. A rule with accepted values refuses any other value with its note.")
    return head + "\n\n" + "\n".join(lines) + "\n"

