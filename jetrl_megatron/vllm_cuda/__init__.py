"""GPU vLLM's own CUDA ops, called by the trainer's forward so that it is vLLM's prefill forward bit for bit.
No Megatron-Core code here (the CUDA twin of :mod:`jetrl_megatron.vllm_cpu`)."""
