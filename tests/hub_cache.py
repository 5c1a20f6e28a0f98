"""Test helpers: a Hugging Face hub cache built in a temporary folder, laid out as huggingface_hub writes it
(``models--org--name/snapshots/<rev>/...`` and ``refs/main``; datasets under ``datasets--org--name``), and a tiny
character tokenizer with a chat template, so hub ids resolve offline exactly as on a cluster with a warm cache."""

from __future__ import annotations

import json
from pathlib import Path

REVISION = "0123456789abcdef0123456789abcdef01234567"
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")


def snapshot_dir(cache: Path, repo_id: str, repo_type: str = "model") -> Path:
    """The snapshot folder of ``repo_id`` in ``cache`` (created, with ``refs/main`` pointing at it)."""
    repo = Path(cache) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    folder = repo / "snapshots" / REVISION
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_config(cache: Path, repo_id: str, config: dict) -> Path:
    folder = snapshot_dir(cache, repo_id)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def write_char_tokenizer(folder: Path, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """A character tokenizer of vocabulary 128 (id = code point, 0 = pad, "\\n" = end of sequence), saved by
    transformers (tokenizer.json, tokenizer_config.json, chat template)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{chr(i): i for i in range(1, 128)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="?"))  # no merges: one token per character
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="\n", pad_token="<pad>", unk_token="?")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)


def write_tiny_model(cache: Path, repo_id: str, *, tokenizer: bool = True) -> Path:
    """The ``tiny`` preset's random BF16 checkpoint (config.json + model.safetensors) and a character tokenizer."""
    from jetrl_megatron.rollout.model_dir import write_tiny_model_dir

    folder = snapshot_dir(cache, repo_id)
    write_tiny_model_dir(folder, preset="tiny")
    if tokenizer:
        write_char_tokenizer(folder)
    return folder


def offline_hub(tmp_path: Path, monkeypatch, *, datasets_too: bool = False) -> Path:
    """An empty offline hub cache in tmp, as huggingface_hub reads it from HF_HUB_CACHE + HF_HUB_OFFLINE=1 (and,
    with ``datasets_too``, an offline ``datasets`` cache beside it)."""
    from huggingface_hub import constants

    cache = Path(tmp_path) / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    if datasets_too:
        import datasets

        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", Path(tmp_path) / "datasets")
        monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    return cache
