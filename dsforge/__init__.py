"""dsforge: one YAML recipe -> a DeepSpeed ZeRO + Megatron-Core distributed training job."""

__version__ = "0.1.0"
