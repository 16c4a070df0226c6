"""Level 0: what megatron-core and megatron.training need to import and run on the detected platform."""
