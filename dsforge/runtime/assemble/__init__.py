"""Building a rank: the Megatron-Core model, the DeepSpeed engine, kernels, the CPU backend,
weights' initialisation, gradient helpers. May import runtime/guard."""
