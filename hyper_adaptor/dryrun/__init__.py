"""Before the run: what a Megatron command line will cost, predicted in one process without building the model.

``parse(flags, world_size)`` checks a command line as a training run would (megatron's parser and checks, the
adaptor's features) and fills in what a run derives (data-parallel size, padded vocabulary);
``shape.ModelShape.from_args(args)`` is the model and its layout as numbers; ``predict(args)`` is each rank's
device memory by part (``memory.py``). ``python -m hyper_adaptor dry-run`` prints it (``report.py``).
"""

from hyper_adaptor.dryrun.shape import ModelShape, parse

__all__ = ["ModelShape", "parse", "predict", "PARTS"]


def __getattr__(name):
    # memory pulls in the pipeline simulator: loaded when asked for, so parse/shape users do not pay for it
    if name in ("predict", "PARTS", "Prediction", "RankMemory"):
        from hyper_adaptor.dryrun import memory

        return getattr(memory, name)
    raise AttributeError(name)
