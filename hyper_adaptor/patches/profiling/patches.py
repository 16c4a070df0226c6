"""The one patch ``--profile`` registers: a wrap of megatron's ``train_step``.

Why this seam: megatron's ``train`` loop calls ``train_step(..., iteration=iteration)`` once per
iteration, with the number of iterations done so far — the step number megatron's own ``--profile``
window is counted in (nsys starts at the top of iteration ``profile_step_start`` and stops once
``profile_step_end`` iterations are done). Wrapping it gives the window's start, each step's bounds and
its end without touching the loop; megatron's own profiler code in that loop stays off because the
feature's ``adjust`` turns ``args.profile`` off.
"""

from __future__ import annotations

import functools

from hyper_adaptor.patch_manager import Patch

FEATURE = "profiling"


def profiled_train_step(original):
    @functools.wraps(original)
    def train_step(*args, iteration=None, **kwargs):
        from hyper_adaptor.patches.profiling import window

        if iteration is None and len(args) > 7:  # megatron passes it by name; a caller may not
            iteration = args[7]
            args = args[:7]
        active = window.current()
        if active is None or iteration is None:
            return original(*args, iteration=iteration, **kwargs)
        with active.step(iteration):
            return original(*args, iteration=iteration, **kwargs)

    return train_step


def patches(args) -> list[Patch]:
    return [Patch("megatron.training.training.train_step", profiled_train_step, "wrap", FEATURE)]
