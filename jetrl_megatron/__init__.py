"""jetrl_megatron: on-policy FP8 RL on Megatron-Core + vLLM."""

__version__ = "0.1.0"
