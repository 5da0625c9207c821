"""A compact tensor-parallel GPT in plain PyTorch, with Megatron-Core's local-spec parameter layout."""
