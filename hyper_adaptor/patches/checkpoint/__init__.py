"""Seams of megatron.training's checkpointing: what a checkpoint records about the layout that saved it and
the check made before loading it under another (``layout``), and the tracker / restart / preemption paths
(``survival``)."""
