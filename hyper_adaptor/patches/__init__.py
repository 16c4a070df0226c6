"""Megatron-facing replacement code, grouped by the megatron area (or compat concern) it adapts."""
