"""Recipe YAML -> one plain nested dict, the way NeMo-RL v0.7.0 reads its configs.

Why OmegaConf and Hydra's override grammar: NeMo-RL users bring YAMLs that inherit with ``defaults:`` (one path or a
list, later parents win, a section marked ``_override_: true`` replaces instead of merging), interpolate across
sections (``${policy.max_total_sequence_length}``, ``${mul:a,b}``), and override on the command line with Hydra's
syntax (``a.b=1``, ``+a.new=1``, ``++a.b=1``, ``~a.b``). Reading them with the same libraries is what makes a
NeMo-RL YAML mean the same thing here. Typing and key accounting happen afterwards (``rl/config/run_config.py``).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jetrl_megatron.errors import UserError


class ConfigError(UserError):
    """A recipe or override is invalid; the message names the key path."""


def register_resolvers() -> None:
    """The resolvers NeMo-RL's YAMLs use besides OmegaConf's own (``oc.env`` ...)."""
    for name, fn in (("mul", lambda a, b: a * b), ("div", lambda a, b: a / b), ("max", lambda a, b: max(a, b))):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def _read_yaml(path: Path) -> DictConfig:
    try:
        node = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such recipe file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the recipe ({e.strerror})") from None
    except Exception as e:  # yaml.YAMLError and OmegaConf's grammar errors
        raise ConfigError(f"{path}: not a valid recipe YAML: {_one_line(e)}") from None
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path}: a recipe must be a mapping at the top level")
    return node


def _merge_over(base: DictConfig, child: DictConfig) -> DictConfig:
    """``child`` merged over ``base``; a child section with ``_override_: true`` replaces the parent's section
    (NeMo-RL checks the marker on top-level sections; here it works at any depth)."""
    _drop_overridden(base, child)
    return OmegaConf.merge(base, child)


def _drop_overridden(base: Any, child: DictConfig) -> None:
    for key in list(child.keys()):
        node = child._get_node(key)
        if not isinstance(node, DictConfig):
            continue
        if node.get("_override_", False):
            node.pop("_override_")
            if isinstance(base, DictConfig) and key in base:
                base.pop(key)
        elif isinstance(base, DictConfig) and isinstance(base._get_node(key), DictConfig):
            _drop_overridden(base._get_node(key), node)


def load_tree(path: Path, resolve_parent=None, _seen: tuple[Path, ...] = ()) -> DictConfig:
    """The recipe at ``path`` with its ``defaults:`` chain merged in, interpolations not yet resolved.

    ``resolve_parent(name, directory)`` maps a ``defaults`` entry to a file; by default a path relative to the
    recipe's directory (NeMo-RL's rule)."""
    path = path.resolve()
    if path in _seen:
        raise ConfigError(f"recipe inheritance cycle: {' -> '.join(str(p) for p in (*_seen, path))}")
    node = _read_yaml(path)
    if "defaults" not in node:
        return node
    parents = node.pop("defaults")
    if isinstance(parents, str):
        parents = [parents]
    elif isinstance(parents, ListConfig) and all(isinstance(p, str) for p in parents):
        parents = list(parents)
    else:
        raise ConfigError(f"{path}: 'defaults' must be a recipe path or a list of them, got {parents!r}")
    merged = OmegaConf.create({})
    for parent in parents:
        ppath = resolve_parent(parent, path.parent) if resolve_parent else path.parent / parent
        if not Path(ppath).exists():
            raise ConfigError(f"{path}: defaults entry {parent!r} -> {ppath} does not exist")
        merged = _merge_over(merged, load_tree(Path(ppath), resolve_parent, (*_seen, path)))
    return _merge_over(merged, node)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text.split(" full_key:")[0].split(" object_type=")[0]


def _parse_overrides(overrides: list[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            (ov,) = parser.parse_overrides([text])
        except Exception as e:  # hydra's OverrideParseException; one bad override gets one message
            raise ConfigError(f"override {text!r}: {_one_line(e)}") from None
        if ov.is_sweep_override():
            raise ConfigError(f"override {text!r}: sweeps (a=1,2) are a Hydra multirun feature; give one value")
        parsed.append(ov)
    return parsed


def _has_key(tree: DictConfig, key: str) -> bool:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(tree, parent_key, throw_on_missing=False) if parent_key else tree
    return isinstance(parent, DictConfig) and leaf in parent


def _closest_key(key: str, keys: list[str]) -> str | None:
    """The existing key ``key`` most likely misspells: a sibling with a close name, else a close full path."""
    parent, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == parent}
    near = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.75)
    if near:
        return siblings[near[0]]
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.9)
    return near[0] if near else None


def apply_overrides(tree: DictConfig, overrides: list[str]) -> DictConfig:
    """Apply Hydra-style overrides as NeMo-RL's ``run_grpo.py`` does: ``a.b=v`` changes a key that exists,
    ``+a.b=v`` adds one that does not, ``++a.b=v`` sets either way, ``~a.b`` (or ``~a.b=v``, checked) deletes."""
    for text, ov in zip(overrides, _parse_overrides(overrides), strict=True):
        key = ov.key_or_group
        exists = _has_key(tree, key)
        if ov.is_delete():
            if not exists:
                raise ConfigError(f"override {text!r}: cannot delete {key}: no such key in the config")
            parent_key, _, leaf = key.rpartition(".")
            parent = OmegaConf.select(tree, parent_key) if parent_key else tree
            if ov.value() is not None and parent[leaf] != ov.value():
                raise ConfigError(f"override {text!r}: {key} is {parent[leaf]!r}, not {ov.value()!r}")
            parent.pop(leaf)
            continue
        value = ov.value()
        if ov.is_add() and exists:
            raise ConfigError(f"override {text!r}: {key} already exists; change it with {key}=... "
                              f"(or force with ++{key}=...)")
        if not (ov.is_add() or ov.is_force_add()) and not exists:
            near = _closest_key(key, list(leaf_paths(OmegaConf.to_container(tree, resolve=False))))
            hint = f" (did you mean {near}?)" if near else ""
            raise ConfigError(f"override {text!r}: {key} is not in the config{hint}; add it with +{key}=... if it is "
                              "a new key")
        try:
            OmegaConf.update(tree, key, value, merge=False, force_add=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"override {text!r}: {_one_line(e)}") from None
    return tree


def resolve_tree(tree: DictConfig) -> dict[str, Any]:
    """Every ``${...}`` resolved; a failure names the key and the expression."""
    register_resolvers()
    try:
        out = OmegaConf.to_container(tree, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"{key}: cannot resolve the value ({_one_line(e)})") from None
    assert isinstance(out, dict)
    return out


def leaf_paths(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.c": value}`` for every leaf; an empty mapping is a leaf (``{}``), a list is a leaf value."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(leaf_paths(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree} if prefix else {}
