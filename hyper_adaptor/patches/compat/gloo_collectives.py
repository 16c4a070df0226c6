"""Collectives megatron-core calls in shapes NCCL takes and gloo refuses, served on gloo.

NCCL (and HCCL) take a single-tensor all-gather whenever the sizes add up
(``output.numel() == group_size * input.numel()``; a reduce-scatter the other way round), and torch
documents two output forms, the concatenation ``(S*n, ...)`` and the stack ``(S, n, ...)``. gloo takes
only the concatenation: the same number of dimensions and the same trailing ones. So megatron's
``tensor_parallel.gather_split_1d_tensor``, which gathers a (2, 4) slice into a flat (S*8,) buffer,
failed on CPU with "ProcessGroupGloo::allgather: invalid tensor size". gloo's list all-gather likewise
wants every rank's tensor in one shape, while megatron's ``_gather_along_first_dim`` with
``output_split_sizes`` (``gather_from_sequence_parallel_region``, which the MoE all-to-all dispatcher
uses with expert tensor parallelism) gathers uneven row counts. And torch's binding of
``all_to_all_single`` takes split sizes only as a sequence of Python ints, while megatron's MoE
all-to-all token dispatcher hands over its per-rank token counts as tensors: it turns them into
numpy arrays (which the binding takes) only for tensors on a CUDA device (``is_cuda``), so on the
host the first forward died with "all_to_all_single(): incompatible function arguments".

The seam is torch's public entry points, not megatron's functions: the shape contract is torch's,
several megatron modules bind ``dist_all_gather_func`` by value at import (the patch manager rebinds
those), and a list of megatron callers would not keep up with the calls. Only the names on
``torch.distributed`` are wrapped, not distributed_c10d's internals, so torch's coalescing manager,
which recognises recorded ops by identity, keeps working. Each wrap hands the call on unchanged
unless the tensors are on the host, the group's backend is gloo, and the shapes are ones gloo
refuses; the shape test comes first, so the calls gloo takes pay for one comparison:

* single-tensor gather / scatter: the same call on flat views of both tensors (views, not copies, for
  contiguous tensors), which is byte for byte the result NCCL gives, and the same work handle;
* uneven list all-gather: one broadcast from each rank straight into its slot of the output; with
  ``async_op=True`` the caller gets one handle whose ``wait()`` waits for them all;
* ``all_to_all_single`` with split sizes in a tensor: the same call with them as a list of ints, the
  values the CUDA path reads out of its numpy copy. This one is not about gloo: the binding refuses a
  tensor on every backend, and megatron's conversion asks ``is_cuda``, which an Ascend NPU tensor
  answers False, so the wrap (``split_size_patches``) is installed on every device but CUDA; reading
  the sizes synchronises with the device, where megatron's CUDA path synchronises too (its dtoh event).
  Written against torch_npu's documented behaviour and not run on an NPU (none here).

Installed with the rest of the CPU patches (``torch_cpu.torch_patches``): gloo is the CPU backend.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist

from hyper_adaptor.patch_manager import Patch

FEATURE = "compat"
# Single-tensor all-gathers and reduce-scatters under every name megatron (or torch) spells them;
# names absent from the installed torch are skipped.
GATHERS = ("all_gather_into_tensor", "_all_gather_base", "all_gather_single")
SCATTERS = ("reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_single")


def _on_gloo(tensor: torch.Tensor, group) -> bool:
    if tensor.device.type != "cpu":
        return False
    try:
        return "gloo" in str(dist.get_backend(group)).lower()
    except (ValueError, RuntimeError):  # not a member of group, or no process group: torch answers
        return False


def _gloo_takes(whole: torch.Tensor, part: torch.Tensor) -> bool:
    """gloo's rule for the whole (gathered / scattered-from) tensor against one rank's part."""
    return whole.dim() == part.dim() >= 1 and whole.shape[1:] == part.shape[1:]


def _flat_on_gloo(whole_is_output: bool):
    """Wrap factory for a single-tensor all-gather (the output is the whole) or reduce-scatter (the
    input is the whole): shapes gloo refuses, but whose sizes add up, go as flat views."""

    def wrap(original):
        signature = inspect.signature(original)
        out_name, in_name = list(signature.parameters)[:2]

        @functools.wraps(original)
        def flat_on_gloo(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            output, inp = bound.arguments[out_name], bound.arguments[in_name]
            whole, part = (output, inp) if whole_is_output else (inp, output)
            if isinstance(whole, torch.Tensor) and isinstance(part, torch.Tensor) and not _gloo_takes(whole, part):
                group = bound.arguments.get("group")
                if output.is_contiguous() and _on_gloo(output, group) and \
                        whole.numel() == dist.get_world_size(group) * part.numel():
                    bound.arguments[out_name] = output.view(-1)
                    bound.arguments[in_name] = inp.reshape(-1)
            return original(*bound.args, **bound.kwargs)

        return flat_on_gloo

    return wrap


class AllWorks:
    """One work handle for a collective served as several: ``wait()`` waits for each once (a second
    wait on a finished gloo work is not safe), then copies results that went through a contiguous
    stand-in into their destination."""

    def __init__(self, works, copy_back=()):
        self._works = list(works)
        self._copy_back = list(copy_back)
        self._done = False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            for work in self._works:
                work.wait() if timeout is None else work.wait(timeout)
            for destination, stand_in in self._copy_back:
                destination.copy_(stand_in)
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or all(work.is_completed() for work in self._works)


def _uneven_on_gloo(original):
    """Wrap ``all_gather(tensor_list, tensor, group, async_op)``: list entries of differing shapes
    on gloo are filled by one broadcast per rank."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def all_gather(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        outputs, tensor = bound.arguments["tensor_list"], bound.arguments["tensor"]
        group, async_op = bound.arguments.get("group"), bound.arguments.get("async_op", False)
        if _uneven(outputs, tensor) and _on_gloo(tensor, group) and len(outputs) == dist.get_world_size(group):
            mine = outputs[dist.get_rank(group)]
            if mine.numel() == tensor.numel() and all(
                    out.dtype == tensor.dtype and out.device == tensor.device for out in outputs):
                return _gather_by_broadcasts(outputs, tensor, group, async_op)
        return original(*bound.args, **bound.kwargs)

    return all_gather


def _uneven(outputs, tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and isinstance(outputs, (list, tuple)) and all(
        isinstance(out, torch.Tensor) for out in outputs) and any(out.shape != tensor.shape for out in outputs)


def _gather_by_broadcasts(outputs, tensor, group, async_op):
    me = dist.get_rank(group)
    works, copy_back = [], []
    for source, out in enumerate(outputs):
        if out.numel() == 0:  # every rank holds the same list of shapes, so every rank skips it
            continue
        slot = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        if source == me:
            slot.copy_(tensor.reshape(slot.shape))
        if slot is not out:
            copy_back.append((out, slot))
        works.append(dist.broadcast(slot, group=group, group_src=source, async_op=True))
    handle = AllWorks(works, copy_back)
    if async_op:
        return handle
    handle.wait()
    return None


def _split_sizes_as_ints(original):
    """Wrap ``all_to_all_single``: split sizes given as a tensor go on as a list of Python ints."""
    signature = inspect.signature(original)
    names = ("output_split_sizes", "input_split_sizes")

    @functools.wraps(original)
    def all_to_all_single(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        sizes = [bound.arguments.get(name) for name in names]
        if any(isinstance(size, torch.Tensor) for size in sizes):
            for name, size in zip(names, sizes):
                if isinstance(size, torch.Tensor):
                    bound.arguments[name] = [int(n) for n in size.reshape(-1).tolist()]
        return original(*bound.args, **bound.kwargs)

    return all_to_all_single


def patches() -> list[Patch]:
    """The gloo shape fixes, for the names this torch has."""
    result = [Patch(f"torch.distributed.{name}", _flat_on_gloo(True), "wrap", FEATURE)
              for name in GATHERS if hasattr(dist, name)]
    result += [Patch(f"torch.distributed.{name}", _flat_on_gloo(False), "wrap", FEATURE)
               for name in SCATTERS if hasattr(dist, name)]
    result.append(Patch("torch.distributed.all_gather", _uneven_on_gloo, "wrap", FEATURE))
    return result + split_size_patches()


def split_size_patches() -> list[Patch]:
    """``all_to_all_single`` with tensor split sizes, for every device whose tensors megatron does not
    convert itself (all but CUDA)."""
    return [Patch("torch.distributed.all_to_all_single", _split_sizes_as_ints, "wrap", FEATURE)]
