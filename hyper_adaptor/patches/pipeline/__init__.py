"""Level 2 pipeline schedules in place of megatron's (feature ``pipeline``, docs/features/pipeline.md)."""


def model_chunks(args) -> int:
    """Model chunks per pipeline rank as megatron will build them (its validate_args derives the same from
    whichever of its three flags is given); read by the pipeline feature and the checkpoint layout record."""
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if vpp:
        return int(vpp)
    stages = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    if stages:
        return int(stages)
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    layers = getattr(args, "num_layers", None)
    if per_stage and layers:
        pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
        return max(1, int(layers) // pp // int(per_stage))
    return 1
