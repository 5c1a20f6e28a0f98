"""RunLogger's W&B run (offline) holds what was logged: the same scalars, names and steps as TensorBoard.

Why the transaction log is read here rather than wandb-summary.json: an offline run of wandb 0.31 writes only
``run-<id>.wandb`` (no summary file until it is synced), and wandb no longer ships a Python reader for it. The file is
a LevelDB-style log of wandb's own protobuf ``Record`` messages, so a few lines below read it independently of the
code under test."""

from __future__ import annotations

import json
import random
import struct
import sys
import time
from pathlib import Path

import pytest

from jetrl_megatron.errors import UserError
from jetrl_megatron.rl.outputs.metric_log import RunLogger, read_metrics, wandb_init_kwargs

pytest.importorskip("wandb")

_BLOCK = 32768  # LevelDB log block size; a record header never straddles a block
_HEADER = 7  # crc32 (4) + length (2) + type (1)


def _records(path: Path) -> list:
    """Every ``wandb_internal_pb2.Record`` in a ``.wandb`` file, in order (FULL, or FIRST..MIDDLE..LAST chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, chunks, out = 7, b"", []
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:
            pos += _BLOCK - pos % _BLOCK  # block trailer padding
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if length == 0 and kind == 0:
            break  # zero padding at the end
        chunks += data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            rec = pb.Record()
            rec.ParseFromString(chunks)
            out.append(rec)
            chunks = b""
    return out


def _complete_records(path: Path, timeout_s: float = 60.0) -> list:
    """The file's records once wandb's service has written the run's ``exit`` record. Why wait: ``wandb.finish()``
    hands the run to a separate service process, which may still be writing when it returns on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _history(records) -> dict[int, dict]:
    """step -> {name: value} of the user's scalars (wandb's own ``_*`` entries dropped)."""
    rows: dict[int, dict] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {_key(i): json.loads(i.value_json) for i in r.history.item}
            rows.setdefault(row["_step"], {}).update({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def _config(records) -> dict:
    cfg = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        items = r.config.update if kind == "config" else r.run.config.update if kind == "run" else []
        cfg.update({_key(i): json.loads(i.value_json) for i in items})
    return cfg


def _tensorboard(tb_dir: Path) -> dict[int, dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    rows: dict[int, dict] = {}
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            rows.setdefault(ev.step, {})[tag] = ev.value
    return rows


@pytest.fixture
def offline_env(tmp_path, monkeypatch):
    """wandb offline and silent, with its config, cache, data and home (~/.netrc) under tmp_path; no API key."""
    home = tmp_path / "home"
    home.mkdir()
    for k in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    for k, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"),
                   ("WANDB_ARTIFACT_DIR", "artifacts")):
        monkeypatch.setenv(k, str(home / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    return tmp_path


def test_wandb_offline_matches_logged(offline_env):
    log_dir = offline_env / "run"
    rng = random.Random(7)
    run_config = {"grpo": {"max_num_steps": 6, "seed": 3}, "policy": {"model_name": "tiny"}, "name": "t"}
    logger = RunLogger(log_dir, progress=False, wandb_cfg={"project": "jetrl-test", "name": "offline-check"},
                       run_config=run_config)
    logged: dict[int, dict] = {}
    steps = [0, 1, 2, 3, 5, 6]  # a gap, as a run without a metric on some step would have
    for step in steps:
        scalars = {"reward/mean": rng.random(), "train/loss": rng.uniform(-3, 3), "refit/bytes": rng.randint(1, 10**9)}
        if step % 2:
            scalars["val/accuracy"] = rng.random()
        logger.log(step, {**scalars, "mismatch/nan": float("nan"), "flag": True, "note": "text"})
        logged[step] = scalars
    logger.close()
    logger.close()  # idempotent

    runs = list((log_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    files = list(runs[0].glob("run-*.wandb"))
    assert len(files) == 1, files
    records = _complete_records(files[0])
    hist = _history(records)
    assert sorted(hist) == steps, [r.WhichOneof("record_type") for r in records]
    for step in steps:  # every logged scalar, exactly; the NaN, the bool and the string are dropped as in TB
        assert hist[step] == logged[step], step
    last = {k: v for s in steps for k, v in logged[s].items()}
    assert {k: v for s in sorted(hist) for k, v in hist[s].items()} == last

    tb = _tensorboard(log_dir / "tb")  # the same names at the same steps (TB stores float32)
    assert sorted(tb) == steps
    for step in steps:
        assert set(tb[step]) == set(hist[step])
        assert tb[step] == pytest.approx(hist[step], rel=1e-6)

    cfg = _config(records)
    assert cfg["grpo"] == run_config["grpo"] and cfg["policy"] == run_config["policy"]
    assert [r["step"] for r in read_metrics(log_dir)] == steps  # metrics.jsonl unchanged in behaviour


def test_init_kwargs_mode_and_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    kw = wandb_init_kwargs(tmp_path, {"project": "p", "name": "n", "tags": ["a"]})
    assert kw == {"project": "p", "name": "n", "tags": ["a"], "mode": "offline", "dir": str(tmp_path)}
    assert wandb_init_kwargs(tmp_path, {"mode": "online"})["mode"] == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the environment wins over the block
    assert wandb_init_kwargs(tmp_path, {"mode": "online"})["mode"] == "disabled"
    assert wandb_init_kwargs(tmp_path, {"dir": "/elsewhere"})["dir"] == "/elsewhere"


def test_unknown_key_and_missing_package(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with pytest.raises(UserError, match="projekt"):
        RunLogger(tmp_path / "a", tensorboard=False, progress=False, wandb_cfg={"projekt": "typo"})
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(UserError, match="pip install wandb"):
        RunLogger(tmp_path / "b", tensorboard=False, progress=False, wandb_cfg={"project": "p"})
    RunLogger(tmp_path / "c", tensorboard=False, progress=False).close()  # off: wandb never imported
