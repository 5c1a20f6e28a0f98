"""Hugging Face hub ids (``org/name``) resolved through huggingface_hub's own cache, as NeMo-RL's transformers calls do.

Why here: `jetrl plan` needs a hub model's ``config.json``, `jetrl run` its weights and tokenizer, and a cluster
holds them in a local cache (``HF_HOME`` / ``HF_HUB_CACHE``, often with ``HF_HUB_OFFLINE=1``). Every lookup goes
through ``huggingface_hub.snapshot_download`` (the cache first, the hub only when online and the cache lacks the
files), so the cache layout is the library's, never ours. Where the cache is comes from huggingface_hub's own reading
of the environment, taken once when the run's config is loaded (:class:`HubCache`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

from jetrl_megatron.errors import UserError, one_line

# What each use needs from a model repository (file name patterns; one match of each group must be present).
CONFIG_FILES: tuple[tuple[str, ...], ...] = (("config.json",),)
WEIGHT_FILES: tuple[tuple[str, ...], ...] = (("config.json",), ("*.safetensors",))
TOKENIZER_FILES: tuple[tuple[str, ...], ...] = (("tokenizer.json", "tokenizer.model", "vocab.json",
                                                  "tokenizer_config.json"),)
# Downloaded for each use when online (configs, weights, tokenizer vocabularies and chat templates).
_PATTERNS = {CONFIG_FILES: ["config.json"], WEIGHT_FILES: ["*.json", "*.safetensors"],
             TOKENIZER_FILES: ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]}


class HubLookupError(UserError, FileNotFoundError):
    """A hub id that is neither in the local cache nor downloadable (offline, or the hub refused)."""


@dataclass(frozen=True)
class HubCache:
    """The Hugging Face cache a run reads (``cache_dir``: huggingface_hub's ``HF_HUB_CACHE``, from ``HF_HUB_CACHE``
    or ``HF_HOME``) and whether it may download (``offline``: ``HF_HUB_OFFLINE``)."""

    cache_dir: str
    offline: bool

    @classmethod
    def from_env(cls) -> HubCache:
        """As huggingface_hub resolved the environment (its ``constants``), so both read the same cache."""
        from huggingface_hub import constants

        return cls(cache_dir=str(constants.HF_HUB_CACHE), offline=bool(constants.HF_HUB_OFFLINE))

    def where(self) -> str:
        return f"the Hugging Face cache {self.cache_dir}" + (" (HF_HUB_OFFLINE=1)" if self.offline else "")


def is_hub_id(name: str) -> bool:
    """``name`` is a hub repo id (``org/name``) and not a path on this machine."""
    if not name or "/" not in name or Path(name).expanduser().exists() or name.startswith((".", "/", "~")):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _has(folder: Path, need: tuple[tuple[str, ...], ...]) -> bool:
    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    return all(any(fnmatch.filter(names, pattern) for pattern in group) for group in need)


def _describe(need: tuple[tuple[str, ...], ...]) -> str:
    return " and ".join(" or ".join(group) for group in need)


def cached_snapshot(repo_id: str, hub: HubCache, *, repo_type: str = "model") -> Path | None:
    """The cached snapshot folder of ``repo_id`` (its ``main`` revision), or None; never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, cache_dir=hub.cache_dir, local_files_only=True))
    except LocalEntryNotFoundError as e:  # IncompleteSnapshotError too: what is there may still be enough
        path = getattr(e, "snapshot_path", None)
        return Path(path) if path else None


def snapshot(repo_id: str, hub: HubCache, *, key: str, need: tuple[tuple[str, ...], ...] = CONFIG_FILES,
             repo_type: str = "model") -> Path:
    """The local snapshot folder of ``repo_id`` holding ``need`` (e.g. :data:`WEIGHT_FILES`): from the cache, else
    downloaded when ``hub`` is online. :class:`HubLookupError` (one line naming ``key``, the id and the cache) if
    neither."""
    from huggingface_hub import snapshot_download

    folder = cached_snapshot(repo_id, hub, repo_type=repo_type)
    if folder is not None and _has(folder, need):
        return folder
    missing = f"{key}: {repo_id!r} ({_describe(need)}) is not in {hub.where()}"
    if hub.offline:
        raise HubLookupError(f"{missing}; download it where the hub is reachable (`hf download {repo_id}`"
                             f"{' --repo-type ' + repo_type if repo_type != 'model' else ''}) into that cache, or "
                             "point the key at a local copy")
    try:
        folder = Path(snapshot_download(repo_id, repo_type=repo_type, cache_dir=hub.cache_dir,
                                        allow_patterns=_PATTERNS.get(need)))
    except Exception as e:  # the hub unreachable, a gated or missing repo: one line with the library's reason
        raise HubLookupError(f"{missing}, and downloading it failed ({one_line(e, limit=200)})") from None
    if not _has(folder, need):
        raise HubLookupError(f"{key}: {repo_id!r} has no {_describe(need)} on the hub (downloaded to {folder})")
    return folder
