"""Level 2 pipeline schedules in place of megatron's (feature ``pipeline``, docs/features/pipeline.md)."""
