"""Process-group helpers of the run: rank, world, data-parallel slices, seeding, rank-0 output.

Why one module: every part of the loop asks "which rank am I, which DP slice is mine, may I print"; answering it
in one place keeps those answers consistent (and the rest of rl/ free of torch.distributed calls)."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import torch

from jetrl_megatron.megatron.cpu import init_parallel
from jetrl_megatron.rl.config import RunConfig


def torch_dist():
    return torch.distributed


def dist_rank() -> int:
    return torch_dist().get_rank() if torch_dist().is_initialized() else 0


def dist_world() -> int:
    return torch_dist().get_world_size() if torch_dist().is_initialized() else 1


def is_main() -> bool:
    return dist_rank() == 0


def say(msg: str) -> None:
    """A line on rank 0's stdout, above any progress bar (tqdm clears and redraws its bars around it, so the line is
    never spliced into a bar's redraw)."""
    if is_main():
        from tqdm import tqdm

        tqdm.write(msg, file=sys.stdout)
        sys.stdout.flush()


def warn(msg: str) -> None:
    if is_main():
        print(f"jetrl run: {msg}", file=sys.stderr, flush=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def dp_coords():
    from megatron.core import parallel_state

    return (parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_group())


def dp_slice(x: torch.Tensor) -> torch.Tensor:
    size, rank, _ = dp_coords()
    per = x.shape[0] // size
    return x[rank * per:(rank + 1) * per]


def dp_gather(x: torch.Tensor) -> torch.Tensor:
    size, _, group = dp_coords()
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    torch_dist().all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, 0)


def init_distributed(cfg: RunConfig) -> None:
    mc = cfg.policy.megatron_cfg
    for k, v in (mc.env_vars or {}).items():
        os.environ.setdefault(k, str(v))
    os.environ.update(cfg.rollout_env())  # vllm_cfg.env_vars and use_deep_gemm's switches, before vLLM is imported
    init_parallel(mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist_rank() % torch.cuda.device_count())))
