"""Checks run in one gloo world: megatron-core's gathers and scatters in the shapes it passes them.

Every rank's data is a function of its rank, so the expected result is computed with plain
equal-shape ``all_gather`` calls (which gloo has always taken) and compared exactly. Each check is
run a second time with the level-0 wraps taken off (torch.distributed and the names megatron bound
at import), to show which of them fail without the fix.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist

from hyper_adaptor.patches.compat import gloo_collectives

WRAPPED = gloo_collectives.GATHERS + gloo_collectives.SCATTERS + ("all_gather",)


def _data(rank, shape, dtype=torch.float32):
    numel = 1
    for size in shape:
        numel *= size
    return (torch.arange(numel, dtype=torch.float32) + 1000 * rank).reshape(shape).to(dtype)


def _reference_gather(tensor, group):
    """The gathered rows of every rank's ``tensor`` (first dim may differ): padded to equal shape,
    gathered with plain all_gather, trimmed."""
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([tensor.shape[0]]), group=group)
    rows = max(int(s) for s in sizes)
    padded = torch.zeros((rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[: int(size)] for part, size in zip(parts, sizes)])


def _reference_sum(tensor, group):
    total = tensor.clone()
    dist.all_reduce(total, group=group)
    return total


@contextlib.contextmanager
def level0_wraps_off():
    """torch.distributed's own functions where level 0 put its wraps, also in the megatron modules
    that bound them by value at import (``dist_all_gather_func``)."""
    import hyper_adaptor.megatron_adaptor as adaptor

    swapped = []
    for name in WRAPPED:
        if not hasattr(dist, name):
            continue
        wrapper = getattr(dist, name)
        try:
            original = adaptor.ADAPTOR.manager.original(f"torch.distributed.{name}")
        except KeyError:  # not wrapped here: nothing to take off
            continue
        namespaces = [vars(dist)] + [vars(m) for n, m in list(sys.modules.items())
                                     if n.startswith("megatron.") and m is not None]
        for namespace in namespaces:
            for key, value in list(namespace.items()):
                if value is wrapper:
                    namespace[key] = original
                    swapped.append((namespace, key, wrapper))
    try:
        yield
    finally:
        for namespace, key, wrapper in swapped:
            namespace[key] = wrapper


def _checks(rank, tp_group):
    """name -> callable returning True when megatron's result equals the reference."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import utils as tp_utils

    tp = tp_group.size()
    tp_rank = tp_group.rank()
    checks = {}

    def gather_split_1d_megatron_test():
        # megatron's own unit test: a (2, 4) tensor of this rank's number, gathered flat
        tensor = torch.ones((2, 4), device="cuda") * rank
        return torch.equal(tp_utils.gather_split_1d_tensor(tensor),
                           _reference_gather(tensor.flatten(), tp_group))

    def split_gather_1d_round_trip():
        whole = _data(0, (3, 2 * tp))  # the same on every rank
        ok = True
        for new_buffer in (False, True):
            chunk = tp_utils.split_tensor_into_1d_equal_chunks(whole, new_buffer=new_buffer)
            ok &= torch.equal(tp_utils.gather_split_1d_tensor(chunk), whole.flatten())
            # the gather of a chunk shaped like a matrix, as a model's weight slice would be
            ok &= torch.equal(tp_utils.gather_split_1d_tensor(chunk.reshape(3, 2)), whole.flatten())
        return ok

    def gather_first_dim_odd_shape():
        tensor = _data(rank, (3, 5))
        expected = _reference_gather(tensor, tp_group)
        plain = mappings._gather_along_first_dim(tensor, tp_group)
        pooled = mappings._gather_along_first_dim(tensor, tp_group, use_global_buffer=True)
        return torch.equal(plain, expected) and torch.equal(pooled, expected)

    def gather_first_dim_uneven():
        sizes = [r % 3 for r in range(tp)]  # rank 0 holds no rows; sizes 0, 1, 2, 0, ...
        tensor = _data(rank, (sizes[tp_rank], 3))
        expected = _reference_gather(tensor, tp_group)
        plain = mappings._gather_along_first_dim(tensor, tp_group, output_split_sizes=sizes)
        pooled = mappings._gather_along_first_dim(tensor, tp_group, output_split_sizes=sizes,
                                                  use_global_buffer=True)
        return torch.equal(plain, expected) and torch.equal(pooled, expected)

    def sequence_parallel_gather_uneven_with_backward():
        # the MoE all-to-all dispatcher's call with expert tensor parallelism: uneven token counts
        sizes = [r + 1 for r in range(tp)]
        tensor = _data(rank, (sizes[tp_rank], 4)).requires_grad_()
        out = mappings.gather_from_sequence_parallel_region(tensor, group=tp_group, output_split_sizes=sizes)
        weight = _data(0, tuple(out.shape))
        (out * weight).sum().backward()
        offset = sum(sizes[:tp_rank])
        # backward is a reduce-scatter of the same weights from every rank
        grad_expected = tp * weight[offset: offset + sizes[tp_rank]]
        return torch.equal(out.detach(), _reference_gather(tensor.detach(), tp_group)) and torch.equal(
            tensor.grad, grad_expected)

    def reduce_scatter_first_dim():
        tensor = _data(rank, (2 * tp, 3))
        total = _reference_sum(tensor, tp_group)
        even = mappings._reduce_scatter_along_first_dim(tensor, tp_group)
        sizes = [r % 3 for r in range(tp)]
        sizes[-1] += 2 * tp - sum(sizes)
        uneven = mappings._reduce_scatter_along_first_dim(tensor, tp_group, input_split_sizes=sizes)
        offset = sum(sizes[:tp_rank])
        return torch.equal(even, total[2 * tp_rank: 2 * tp_rank + 2]) and torch.equal(
            uneven, total[offset: offset + sizes[tp_rank]])

    def last_dim_gather_and_reduce_scatter():
        tensor = _data(rank, (2, 3, 5))
        gathered = mappings._gather_along_last_dim(tensor, tp_group)
        expected = torch.cat(list(_reference_gather(tensor, tp_group).chunk(tp, dim=0)), dim=-1)
        wide = _data(rank, (2, 3, 2 * tp))
        scattered = mappings._reduce_scatter_along_last_dim(wide, tp_group)
        mine = _reference_sum(wide, tp_group)[..., 2 * tp_rank: 2 * tp_rank + 2]
        return torch.equal(gathered, expected) and torch.equal(scattered, mine)

    def all_to_all_uneven():
        # row i of every rank goes to rank i % tp: uneven splits, gloo's own all_to_all_single
        rows = 2 * tp + 1
        send = [sum(1 for i in range(rows) if i % tp == dst) for dst in range(tp)]
        tensor = _data(rank, (rows, 2))
        order = sorted(range(rows), key=lambda i: i % tp)
        receive = [send[tp_rank]] * tp
        out = mappings.all_to_all(tp_group, tensor[order], receive, send)
        mine = _reference_gather(tensor, tp_group).reshape(tp, rows, 2)[:, [i for i in order if i % tp == tp_rank]]
        return torch.equal(out, mine.reshape(-1, 2))

    def torch_forms_gloo_refused():
        # what NCCL takes: a stacked output, a flat output for a matrix input, a scalar input,
        # bf16, async handles, and a flat whole in a reduce-scatter of matrices
        group = tp_group
        tensor = _data(rank, (2, 4))
        expected = _reference_gather(tensor, group)
        stacked = torch.empty(tp, 2, 4)
        dist.all_gather_into_tensor(stacked, tensor, group=group)
        flat = torch.empty(tp * 8, dtype=torch.bfloat16)
        work = dist.all_gather_into_tensor(flat, tensor.to(torch.bfloat16), group=group, async_op=True)
        work.wait()
        scalars = torch.empty(tp)
        dist.all_gather_into_tensor(scalars, torch.tensor(float(rank)), group=group)
        mine = torch.empty(2, 4)
        work = dist.reduce_scatter_tensor(mine, expected.reshape(-1), group=group, async_op=True)
        work.wait()
        from_stack = torch.empty(8)
        dist.reduce_scatter_tensor(from_stack, expected.reshape(tp, 2, 4), group=group)
        return (torch.equal(stacked.reshape(-1, 4), expected)
                and torch.equal(flat, expected.reshape(-1).to(torch.bfloat16))
                and torch.equal(scalars, _reference_gather(torch.tensor([float(rank)]), group))
                and torch.equal(mine, tp * expected[2 * tp_rank: 2 * tp_rank + 2])
                and torch.equal(from_stack, tp * expected[2 * tp_rank: 2 * tp_rank + 2].reshape(-1)))

    def coalesced_flat_output():
        # the distributed optimizer's shape of call, under torch's coalescing manager
        from torch.distributed.distributed_c10d import _coalescing_manager

        tensors = [_data(rank, (2, 4)), _data(rank, (3,))]
        outputs = [torch.empty(tp * 8), torch.empty(tp * 3)]
        with _coalescing_manager(tp_group, async_ops=True) as manager:
            for out, tensor in zip(outputs, tensors):
                dist.all_gather_into_tensor(out, tensor, group=tp_group, async_op=True)
        manager.wait()
        return all(torch.equal(out, _reference_gather(t.reshape(-1), tp_group)) for out, t in zip(outputs, tensors))

    def uneven_all_gather_async():
        sizes = [r + 1 for r in range(tp)]
        out = torch.empty(sum(sizes), 2)
        parts = list(torch.split(out, sizes))
        tensor = _data(rank, (sizes[tp_rank], 2))
        work = dist.all_gather(parts, tensor, group=tp_group, async_op=True)
        work.wait()
        # a column slice: the parts are not contiguous
        wide = torch.zeros(sum(sizes), 3)
        dist.all_gather(list(torch.split(wide[:, 1:], sizes)), tensor, group=tp_group)
        # the layer-wise optimizer's form: flat slices of uneven size, this rank's slot the input itself
        flat = tensor.reshape(-1).clone()
        slots = [flat if r == tp_rank else torch.empty(2 * size) for r, size in enumerate(sizes)]
        dist.all_gather(slots, flat, group=tp_group)
        expected = _reference_gather(tensor, tp_group)
        return (torch.equal(out, expected) and torch.equal(wide[:, 1:], expected) and not wide[:, 0].any()
                and torch.equal(torch.cat(slots), expected.reshape(-1)))

    for fn in (gather_split_1d_megatron_test, split_gather_1d_round_trip, gather_first_dim_odd_shape,
               gather_first_dim_uneven, sequence_parallel_gather_uneven_with_backward,
               reduce_scatter_first_dim, last_dim_gather_and_reduce_scatter, all_to_all_uneven,
               torch_forms_gloo_refused, coalesced_flat_output, uneven_all_gather_async):
        checks[fn.__name__] = fn
    return checks


def _run(checks):
    results = {}
    for name, fn in checks.items():
        try:
            results[name] = bool(fn())
        except Exception as error:
            results[name] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return results


def megatron_collectives(rank: int, world_size: int) -> dict:
    """Each check with level 0 on and with its wraps off, for megatron's unit-test layout (TP2 over
    the pipeline ranks) and for one tensor-parallel group of the whole world."""
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    result = {}
    for tp in sorted({2, world_size}):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=world_size // tp)
        checks = _checks(rank, ps.get_tensor_model_parallel_group())
        fixed = _run(checks)
        with level0_wraps_off():
            unfixed = _run(checks)
        result[f"tp{tp}"] = {"fixed": fixed, "unfixed": unfixed}
        dist.barrier()
        ps.destroy_model_parallel()
    return result
