"""Run logging: one JSON line per step, TensorBoard scalars, optional W&B (offline by default), tqdm progress, and a
PNG summary plot at the end.

``metrics.jsonl`` is the source of truth (appended and flushed every step, so a crashed run keeps its history and a
resumed run continues the same file); TensorBoard, W&B and the plot are views of it. TensorBoard and W&B get the same
scalars under the same names and steps.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from jetrl_megatron.errors import UserError


def _finite_or_none(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/Inf; a None is visible and fails the schema test
    return v


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float | int]:
    """The finite int/float entries of ``metrics``: what TensorBoard and W&B both receive, so their names agree."""
    return {k: v for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def wandb_init_kwargs(log_dir: Path, wandb_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``wandb.init`` arguments for NeMo-RL's ``logger.wandb`` block (every key is passed through, as NeMo-RL does).

    Why offline by default: runs happen on machines without network; ``wandb sync <log_dir>/wandb/offline-run-*``
    uploads later. ``WANDB_MODE`` in the environment wins over the block's ``mode``. ``dir`` defaults to the run's
    log dir, so the run lands in ``<log_dir>/wandb/``."""
    kwargs = dict(wandb_cfg)
    kwargs["mode"] = os.environ.get("WANDB_MODE") or kwargs.get("mode") or "offline"
    kwargs.setdefault("dir", str(log_dir))
    return kwargs


def _as_dict(run_config: Any) -> dict[str, Any]:
    return dataclasses.asdict(run_config) if dataclasses.is_dataclass(run_config) else dict(run_config)


def start_wandb(log_dir: Path, wandb_cfg: Mapping[str, Any], run_config: Any = None) -> Any:
    """A W&B run for this log dir, the resolved run config as its config (NeMo-RL: ``run.config.update``).

    wandb is imported here, not at module import: it is heavy and only needed when W&B is on."""
    try:
        import wandb
    except ImportError as e:
        raise UserError(f"logger.wandb_enabled needs the wandb package ({e}): `pip install wandb`, or set "
                        "logger.wandb_enabled=false") from None
    kwargs = wandb_init_kwargs(log_dir, wandb_cfg)
    unknown = sorted(set(kwargs) - set(inspect.signature(wandb.init).parameters))
    if unknown:
        raise UserError(f"logger.wandb: {', '.join(unknown)} not argument(s) of wandb.init "
                        f"(wandb {wandb.__version__}); use e.g. project, name, entity, group, tags, notes")
    run = wandb.init(**kwargs)
    if run_config is not None:
        run.config.update(_as_dict(run_config), allow_val_change=True)
    return run


class RunLogger:
    """Writes ``<log_dir>/metrics.jsonl`` (+ TensorBoard events under ``<log_dir>/tb``, + a W&B run under
    ``<log_dir>/wandb`` when ``wandb_cfg`` is given: NeMo-RL's ``logger.wandb`` block; ``run_config``, a dict or a
    dataclass such as the resolved RunConfig, becomes the run's config)."""

    def __init__(self, log_dir: str | Path, *, tensorboard: bool = True, progress: bool = True, enabled: bool = True,
                 wandb_cfg: Mapping[str, Any] | None = None, run_config: Any = None):
        self.log_dir = Path(log_dir)
        self.enabled = enabled
        self.progress = progress and enabled
        self.path = self.log_dir / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        if enabled:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.log_dir / "tb"))
            if wandb_cfg is not None:
                self._wandb = start_wandb(self.log_dir, wandb_cfg, run_config)

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps > ``step`` left by a run that died after its last checkpoint."""
        if not (self.enabled and self.path.exists()):
            return
        keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = _scalars(metrics)
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None and scalars:
            self._wandb.log(scalars, step=step)

    def bar(self, iterable: Iterable, desc: str, total: int | None = None) -> Iterator:
        """tqdm over ``iterable`` when progress bars are on, else the iterable itself."""
        if not self.progress:
            return iter(iterable)
        from tqdm import tqdm

        return iter(tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True))

    def close(self) -> None:
        """Flush and close TensorBoard; finish the W&B run (writes its final records; idempotent)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]


PLOT_KEYS = (
    ("reward/mean", "reward"),
    ("reward/accuracy", "accuracy"),
    ("val/accuracy", "validation accuracy (greedy)"),
    ("val/accuracy_sampled", "validation accuracy (sampled)"),
    ("mismatch/k3_kl", "k3 KL (rollout || train)"),
    ("mismatch/token_mult_prob_error", "token_mult_prob_error"),
)


def plot_run(rows: list[dict[str, Any]], out_png: str | Path, title: str = "") -> Path:
    """Reward and mismatch vs step, one panel each, written atomically as a PNG (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [(k, lbl) for k, lbl in PLOT_KEYS if any(k in r for r in rows)]
    fig, axes = plt.subplots(len(keys) or 1, 1, figsize=(7, 2.2 * max(1, len(keys))), sharex=True, squeeze=False)
    for ax, (k, lbl) in zip(axes[:, 0], keys, strict=False):
        pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3)
        ax.set_ylabel(lbl, fontsize=8)
        ax.grid(alpha=0.3)
    return save_step_figure(fig, axes, out_png, title)


def save_step_figure(fig, axes, out_png: str | Path, title: str = "") -> Path:
    """Label the shared step axis, title the top panel and write the PNG atomically (a reader never sees half a
    file); closes the figure."""
    import matplotlib.pyplot as plt

    axes[-1, 0].set_xlabel("GRPO step")
    if title:
        axes[0, 0].set_title(title, fontsize=9)
    fig.tight_layout()
    out_png = Path(out_png)
    tmp = out_png.with_name(out_png.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out_png)
    return out_png


def quiet_libraries() -> None:
    """Keep the run's own progress readable: vLLM logs errors only, known import-time warnings are muted
    (set VLLM_LOGGING_LEVEL=INFO to see vLLM's log again). vLLM reads the variable once, when it is imported; if it
    already was (a process forked warm, `warm_process.py`, or a host that imported it first), its logger and handlers
    get the level directly."""
    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if "vllm" in sys.modules:
        vllm_logger = logging.getLogger("vllm")
        vllm_logger.setLevel(level)
        for handler in vllm_logger.handlers:
            handler.setLevel(level)
    for mod in ("megatron", "vllm", "torch.distributed"):
        warnings.filterwarnings("ignore", category=UserWarning, module=mod)
        warnings.filterwarnings("ignore", category=FutureWarning, module=mod)
