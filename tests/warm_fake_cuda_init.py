"""Preloaded by a warm-process test: makes the server's torch report CUDA as initialized, as a library that touched
the GPU at import would leave it."""

import torch

torch.cuda.is_initialized = lambda: True
