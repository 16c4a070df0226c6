"""Level-2 memory patches: activation swap / recompute on megatron layers, optimizer offload."""
