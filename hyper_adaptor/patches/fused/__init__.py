"""Level-1 patches: megatron-core seams swapped for hyper_adaptor/ops."""
