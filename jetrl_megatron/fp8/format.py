"""The FP8 storage format's constants, defined once for every layer that reads or writes it.

Why a module of its own: the trainer's quantizers, the resharder's block addressing, the vLLM plugin and the
checkpoint export must agree on these byte for byte; it imports nothing, so the vLLM plugin entry point can use it.
"""

BLOCK = 128  # weight blocks are BLOCK x BLOCK, activation / gradient groups 1 x BLOCK
SCALE_SUFFIX = "_scale_inv"  # a weight's FP32 block scales are stored as "<weight name>_scale_inv"
QUANT_METHOD = "jetrl_fp8"  # the vLLM quantization method (and HF quant_method) this project serves
# The plugin's quantization_config key for the engine's quantizer choice (True: the torch reference quantizer on CUDA
# too, bit-identical to the Triton kernels); absent = the kernels. Set by the engine, never written to checkpoints.
REFERENCE_QUANT_KEY = "reference_quant"


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many b-sized blocks cover a."""
    return -(-a // b)
