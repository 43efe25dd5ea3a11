"""Several ranks: 1 against N under DDP / ZeRO / FSDP2, the engine under each launch config, why a launch config's
first rollout differs from one GPU's, and what two ranks sharing one GPU can run. It imports `core` alone."""
