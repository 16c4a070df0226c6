"""Benchmarks (run as scripts from the repository root)."""
