"""Every private torch API this package uses, in one table, with the torch releases it was checked on.

torch gives no compatibility promise for underscore names: a release may move or drop any of them.
This table is what a torch upgrade has to re-check. Two unit tests keep it honest
(tests/unit/test_torch_private_apis.py): every name below must resolve in the running torch (so
``make test-torch TORCH=<version>`` checks them per release), and a scan of the package's source
fails on a private torch use that is missing here.

``name`` is the dotted path from ``torch`` (for an attribute of a class, the class's path then the
attribute: instances of ``DTensor`` carry ``_local_tensor`` as a slot of the class). To add a use:
add a row, run the unit test on CI's torch, and name the releases it was actually checked on.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# The releases `make test-torch` has run the unit and distributed tests on (README, "torch versions").
CHECKED = ("2.13.0", "2.14.1", "2.15.0")


@dataclass(frozen=True)
class PrivateTorchAPI:
    name: str
    used_in: tuple[str, ...]
    why: str
    checked_on: tuple[str, ...] = CHECKED


APIS: tuple[PrivateTorchAPI, ...] = (
    PrivateTorchAPI("torch._C.TensorBase.type", ("patches/compat/torch_cpu.py",),
                    "Tensor.type() as torch defines it, to fall back to from the host-emulated cuda type names"),
    PrivateTorchAPI("torch._C._profiler._ExperimentalConfig", ("patches/profiling/backends.py",),
                    "the profiler's experimental options (cuda sync events); no public constructor"),
    PrivateTorchAPI("torch.cuda.memory._record_memory_history", ("patches/profiling/backends.py",),
                    "the memory-snapshot recorder (device module's memory, cuda here)"),
    PrivateTorchAPI("torch.cuda.memory._dump_snapshot", ("patches/profiling/backends.py",),
                    "writes the recorded memory snapshot"),
    PrivateTorchAPI("torch._dynamo.exc", ("ops/backend.py",),
                    "module name of torch.compile's exceptions, to tell a compiler failure from a kernel's"),
    PrivateTorchAPI("torch._inductor.exc", ("ops/backend.py",), "as torch._dynamo.exc, for inductor's errors"),
    PrivateTorchAPI("torch._inductor.compile_fx", ("testing/world.py",),
                    "preloaded by the tests' forkserver and launcher: what torch.compile imports when called",
                    ("2.13.0",)),
    PrivateTorchAPI("torch._dynamo.backends.debugging", ("testing/world.py",),
                    "preloaded as torch._inductor.compile_fx (it brings aot_autograd)", ("2.13.0",)),
    PrivateTorchAPI("torch.ops.aten.mm.dtype._schema", ("ops/wgrad_accum.py",),
                    "whether aten::mm takes out_dtype (missing on older torch: handled there)"),
    PrivateTorchAPI("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu", ("ops/attention_lse.py",),
                    "attention that also returns the log-sum-exp, CPU"),
    PrivateTorchAPI("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward", ("ops/attention_lse.py",),
                    "its backward"),
    PrivateTorchAPI("torch.ops.aten._scaled_dot_product_efficient_attention", ("ops/attention_lse.py",),
                    "attention that also returns the log-sum-exp, accelerators"),
    PrivateTorchAPI("torch.ops.aten._scaled_dot_product_efficient_attention_backward", ("ops/attention_lse.py",),
                    "its backward"),
    PrivateTorchAPI("torch.utils._pytree.tree_flatten", ("parallel/hsdp/_state.py",), "flattens forward inputs"),
    PrivateTorchAPI("torch.utils._pytree.tree_map", ("parallel/hsdp/_state.py",), "maps forward inputs"),
    PrivateTorchAPI("torch.utils._pytree.tree_leaves", ("testing/measure.py",), "leaves of dispatched arguments"),
    PrivateTorchAPI("torch.utils._python_dispatch.TorchDispatchMode", ("memory/api.py", "testing/measure.py"),
                    "dispatch-level interception (memory accounting, measurement)"),
    PrivateTorchAPI("torch.utils._python_dispatch.is_traceable_wrapper_subclass", ("testing/measure.py",),
                    "tells DTensor-like wrappers apart while measuring"),
    PrivateTorchAPI("torch.utils._python_dispatch._get_current_dispatch_mode", ("testing/peak_run.py",),
                    "which dispatch mode is innermost when a measured run's tracker is left", ("2.13.0",)),
    PrivateTorchAPI("torch.utils._device._device_constructors", ("patches/compat/torch_cpu.py",),
                    "built before the cuda-on-host wraps so the default-device context keeps torch's own factories"),
    PrivateTorchAPI("torch.autograd.Variable._execution_engine", ("parallel/hsdp/_state.py",),
                    "queue_callback: a hook at the end of the whole backward pass"),
    PrivateTorchAPI("torch.distributed.tensor._random.is_rng_supported_mesh", ("parallel/tensor/_torch_private.py",),
                    "whether the DTensor RNG tracker works on a mesh"),
    PrivateTorchAPI("torch.distributed.tensor._random.manual_seed", ("parallel/tensor/_torch_private.py",),
                    "seeds the DTensor RNG tracker"),
    PrivateTorchAPI("torch.distributed.tensor.placement_types._StridedShard",
                    ("parallel/hsdp/_param.py", "parallel/hsdp/api.py"),
                    "the data-parallel placement of a TP-sharded parameter (FSDP2's layout)"),
    PrivateTorchAPI("torch.distributed.tensor.DTensor._local_tensor",
                    ("parallel/hsdp/_param.py", "patches/hsdp/checkpoint.py", "memory/swap_manager.py"),
                    "the local shard without a to_local() autograd node"),
    PrivateTorchAPI("torch.distributed.tensor.DTensor._spec", ("parallel/hsdp/_param.py",),
                    "the spec cached to rebuild DTensors without from_local's checks"),
    PrivateTorchAPI("torch.distributed.device_mesh.DeviceMesh._flatten", ("parallel/hsdp/api.py",),
                    "one group over several mesh dimensions"),
    PrivateTorchAPI("torch.Tensor._base", ("parallel/hsdp/_pool.py", "memory/swap_manager.py"),
                    "a view's base tensor (storage ownership)"),
    PrivateTorchAPI("torch.Tensor._version", ("ops/rope.py",), "in-place change counter, for a cache's validity"),
)


def resolve(name: str):
    """The object ``name`` names in the running torch; AttributeError or ImportError when it is gone."""
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    path = parts[0]
    for part in parts[1:]:
        path = f"{path}.{part}"
        try:
            obj = getattr(obj, part)
        except AttributeError:
            # a submodule not imported by its parent yet
            obj = importlib.import_module(path)
    return obj


def missing() -> list[str]:
    """The listed names the running torch does not have, each with the error it gave."""
    out = []
    for api in APIS:
        try:
            resolve(api.name)
        except (AttributeError, ImportError, RuntimeError) as exc:
            out.append(f"{api.name}: {type(exc).__name__}: {exc}")
    return out
