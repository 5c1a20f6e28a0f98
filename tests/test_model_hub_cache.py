"""Hub ids (``org/name``) for ``policy.model_name`` and the tokenizer resolve through huggingface_hub's cache, as
NeMo-RL's transformers calls resolve them: `jetrl plan` reads config.json there, `jetrl run` loads the weights and
the tokenizer there, and an id that is not there stops with one line naming the id and the cache searched.

The cache is built in each test's tmp folder (tests/hub_cache.py) and selected the way a user selects it: through
huggingface_hub's reading of the environment (its ``constants``, set here by monkeypatch in-process, and by
``HF_HOME`` / ``HF_HUB_OFFLINE`` for the CLI runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hub_cache import offline_hub, snapshot_dir, write_config, write_tiny_model
from published_configs import PUBLISHED

from jetrl_megatron.errors import UserError
from jetrl_megatron.model.hub import HubCache, HubLookupError
from jetrl_megatron.rl.config import REPO_ROOT, load_config

GPU_1B = ["cluster.gpus_per_node=8", "cluster.num_nodes=1", "policy.train_micro_batch_size=16"]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    return offline_hub(tmp_path, monkeypatch)


def test_config_reads_the_cache_once_at_load(hub):
    cfg = load_config("tiny_cpu")
    assert cfg.hub == HubCache(cache_dir=str(hub), offline=True)


@pytest.mark.parametrize("repo_id", ["meta-llama/Llama-3.2-1B-Instruct", "Qwen/Qwen2.5-1.5B"])
def test_plan_reads_config_json_from_the_cache(hub, repo_id):
    from jetrl_megatron.rl.tools.run_plan import model_shape, plan_report

    published = PUBLISHED[repo_id]
    write_config(hub, repo_id, published)
    cfg = load_config("tiny_cpu", [f"policy.model_name={repo_id}", "policy.jet_rl.model_preset=null", *GPU_1B])
    shape = model_shape(cfg)
    heads = published["num_attention_heads"]
    assert (shape.name, shape.hidden_size, shape.num_layers, shape.num_attention_heads, shape.num_kv_heads,
            shape.head_dim, shape.ffn_hidden_size, shape.vocab_size, shape.tie_word_embeddings) == (
        repo_id, published["hidden_size"], published["num_hidden_layers"], heads, published["num_key_value_heads"],
        published.get("head_dim", published["hidden_size"] // heads), published["intermediate_size"],
        published["vocab_size"], published["tie_word_embeddings"])
    text, ok = plan_report(cfg, 80.0, show_config=False)
    assert f"# model: {repo_id} (" in text
    # Llama-3.2-1B's head_dim 64 in this FP8 (jetrl) recipe: the trainer's 128x128 QKV blocks straddle heads, so the
    # byte-exact refit cannot move them (the bf16 arm plans: tests/test_nemo_rl_conformance.py)
    assert ok == (shape.head_dim % 128 == 0), text
    assert ok or "REFUSED [model] self_attn.q_proj/k_proj/v_proj: head_dim 64 is not a multiple of 128" in text


def test_an_id_not_in_the_cache_is_one_line_naming_the_id_and_the_cache(hub):
    from jetrl_megatron.rl.tasks import load_tokenizer
    from jetrl_megatron.rl.tools.run_plan import model_shape
    from jetrl_megatron.rl.trainer import resolve_model_weights

    cfg = load_config("tiny_cpu", ["policy.model_name=meta-llama/Llama-3.1-8B-Instruct",
                                   "policy.jet_rl.model_preset=null", *GPU_1B])
    for lookup in (model_shape, resolve_model_weights, load_tokenizer):
        with pytest.raises(HubLookupError) as e:
            lookup(cfg)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("policy.model_name: 'meta-llama/Llama-3.1-8B-Instruct'"), msg
        assert str(hub) in msg and "HF_HUB_OFFLINE=1" in msg
    # config.json alone is enough to plan, not to train: the weights are named as what is missing
    write_config(hub, "meta-llama/Llama-3.1-8B-Instruct", PUBLISHED["meta-llama/Llama-3.1-8B-Instruct"])
    assert model_shape(cfg).num_layers == 32
    with pytest.raises(HubLookupError, match=r"\(config\.json and \*\.safetensors\) is not in the Hugging Face cache"):
        resolve_model_weights(cfg)
    tok = load_config("tiny_cpu", ["policy.model_name=tiny", "policy.tokenizer.name=org/no-such-tokenizer"])
    with pytest.raises(UserError, match=r"^policy\.tokenizer\.name: 'org/no-such-tokenizer' \(tokenizer\.json or"):
        load_tokenizer(tok)


def test_run_loads_weights_and_tokenizer_from_the_cache(hub):
    """The trainer's weights folder is the cached snapshot, and the tokenizer is the cached one (chat template
    included); online mode still takes a complete cached copy without asking the hub (the endpoint is unreachable)."""
    from jetrl_megatron.rl.tasks import load_tokenizer
    from jetrl_megatron.rl.trainer import resolve_model_weights

    folder = write_tiny_model(hub, "test-org/tiny-char")
    cfg = load_config("tiny_cpu", ["policy.model_name=test-org/tiny-char"])
    assert resolve_model_weights(cfg) == str(folder)
    tok = load_tokenizer(cfg)
    assert tok.encode("7+5", add_special_tokens=False) == [ord(c) for c in "7+5"] and tok.eos_token_id == 10
    assert tok.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False,
                                   add_generation_prompt=True) == "[user]q[assistant]"
    online = load_config("tiny_cpu", ["policy.model_name=test-org/tiny-char"])
    object.__setattr__(online, "hub", HubCache(cache_dir=str(hub), offline=False))
    assert resolve_model_weights(online) == str(folder)


def test_a_local_directory_is_not_a_hub_id(hub, tmp_path):
    from jetrl_megatron.model.hub import is_hub_id

    local = snapshot_dir(tmp_path / "elsewhere", "a/b")
    assert not is_hub_id(str(local)) and not is_hub_id("tiny") and not is_hub_id("./x/y")
    assert is_hub_id("meta-llama/Llama-3.1-8B-Instruct")


@pytest.mark.slow
def test_plan_and_tiny_cpu_run_from_the_cache(tmp_path):
    """`jetrl plan` and a 2-step `jetrl run` of a model known only by its hub id, with HF_HOME at a cache built here
    and HF_HUB_OFFLINE=1 (as on a cluster): the tiny model's weights, its tokenizer, and a NeMo-RL named dataset
    (DeepScaler) all come from that cache."""
    home = tmp_path / "hf"
    write_tiny_model(home / "hub", "test-org/tiny-char")
    data = snapshot_dir(home / "hub", "agentica-org/DeepScaleR-Preview-Dataset", repo_type="dataset")
    rows = [{"problem": f"{a}+{b}", "answer": str(a + b), "solution": "..."} for a in range(4) for b in range(4)]
    (data / "deepscaler.json").write_text(json.dumps(rows))
    template = tmp_path / "prompt.txt"
    template.write_text("{}=")
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_CACHE", None)
    common = ["policy.model_name=test-org/tiny-char", "policy.jet_rl.model_preset=null",
              "data.train.dataset_name=DeepScaler",
              f"data.default.prompt_file={template}", "data.max_input_seq_length=16",
              "policy.generation.max_new_tokens=4", "data.train.split_validation_size=0.25"]
    cli = [sys.executable, "-m", "jetrl_megatron.cli"]
    plan = subprocess.run([*cli, "plan", "--recipe", "tiny_cpu", *common], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO_ROOT)
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
    assert "# model: test-org/tiny-char (qwen3; hidden 256, 4 layers" in plan.stdout
    log_dir = tmp_path / "run"
    run = [*cli, "run", "--recipe", "tiny_cpu", *common, "grpo.max_num_steps=2", "grpo.num_prompts_per_step=4",
           "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8",
           "policy.logprob_batch_size=8", "policy.jet_rl.sft_warmstart.steps=0", "policy.jet_rl.final_arm_probe=false",
           "policy.jet_rl.progress_bars=false", "policy.jet_rl.plot_enabled=false", "grpo.val_period=0",
           "grpo.val_at_start=false", "grpo.val_at_end=false", "logger.tensorboard_enabled=false",
           f"logger.log_dir={log_dir}"]
    r = subprocess.run(run, capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if s["step"] > 0] == [1, 2]
    assert json.loads((log_dir / "summary.json").read_text())["ok"]


def test_a_plan_missing_the_config_names_the_preset_key(hub):
    """Planning needs only the architecture: the hub miss says how to name it without the cache."""
    from jetrl_megatron.rl.tools.run_plan import model_shape

    cfg = load_config("tiny_cpu", ["policy.model_name=meta-llama/Llama-3.1-8B-Instruct",
                                   "policy.jet_rl.model_preset=null", *GPU_1B])
    with pytest.raises(HubLookupError, match=r"policy\.jet_rl\.model_preset=<one of .*llama3\.1-8b") as e:
        model_shape(cfg)
    assert "\n" not in str(e.value)
