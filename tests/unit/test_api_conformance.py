"""HyperParallel's public API, name for name, as data: where each name is exported here, the parameters a
ported call relies on (name, kind, default), enum members and values, methods. Names that cannot fit a
torch library are listed as not served with the reason, and every name of the table must appear in
docs/features/library.md.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.util
import inspect
import pathlib

import pytest

REQUIRED = inspect.Parameter.empty
ANY = object()          # default not checked (torch's own signature spells it its own way)
POS, KW, ARGS, KWARGS = "pos", "kw", "*args", "**kwargs"
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "features" / "library.md"
TENSOR = "hyper_adaptor.parallel.tensor"


@dataclasses.dataclass(frozen=True)
class Ref:
    name: str
    home: str                        # module that exports it
    params: tuple = ()               # (name or "?" for any name, kind, default)
    members: dict | None = None      # enum: member name -> value (None: value not checked)
    methods: dict = dataclasses.field(default_factory=dict)   # method -> params, as above (() not checked)
    status: str = "served"           # served | alias | not served | differs
    why: str = ""


P, M, OPT, PIPE = "hyper_adaptor.parallel", "hyper_adaptor.memory", "hyper_adaptor.optim", "hyper_adaptor.parallel"

SERVED = [
    # ---- HSDP
    Ref("fully_shard", P, (("module", POS, REQUIRED), ("mesh", POS, None), ("reshard_after_forward", KW, True),
                           ("mixed_precision", KW, None), ("offload_policy", KW, None), ("comm_fusion", KW, True),
                           ("comm_fusion_zero_copy", KW, None))),
    Ref("HSDPModule", P),
    Ref("hsdp_sync_stream", P, ()),
    Ref("hsdp", "hyper_adaptor.parallel.hsdp", (("module", POS, REQUIRED), ("shard_size", POS, -1))),
    # ---- tensor (DTensor, Layout, TP styles)
    Ref("Layout", TENSOR, (("mesh_shape", POS, REQUIRED), ("mesh_dim_names", POS, ANY))),
    Ref("DeviceMesh", TENSOR),
    Ref("init_device_mesh", TENSOR, (("device_type", POS, REQUIRED), ("mesh_shape", POS, REQUIRED),
                                     ("mesh_dim_names", KW, ANY))),
    Ref("get_current_mesh", TENSOR),
    Ref("DTensor", TENSOR, methods={"from_local": (("local_tensor", POS, REQUIRED), ("?", POS, ANY)),
                                    "to_local": (), "redistribute": (), "full_tensor": (), "is_partial": (),
                                    "reduce_partial": ()}),
    Ref("is_partial", TENSOR), Ref("reduce_partial", TENSOR),
    Ref("Shard", TENSOR), Ref("Replicate", TENSOR), Ref("Partial", TENSOR), Ref("Placement", TENSOR),
    Ref("distribute_tensor", TENSOR), Ref("distribute_module", TENSOR, (("module", POS, REQUIRED),
                                                                        ("device_mesh", POS, ANY))),
    Ref("ones", TENSOR), Ref("zeros", TENSOR), Ref("empty", TENSOR), Ref("full", TENSOR), Ref("rand", TENSOR),
    Ref("randn", TENSOR),
    Ref("init_parameters", TENSOR, (("?", POS, REQUIRED),)),
    Ref("init_empty_weights", TENSOR), Ref("init_on_device", TENSOR),
    Ref("shard_module", TENSOR),
    Ref("manual_seed", TENSOR, (("seed", POS, REQUIRED),)),
    Ref("ParallelStyle", TENSOR),
    Ref("ColwiseParallel", TENSOR, (("input_layouts", KW, ANY), ("output_layouts", KW, ANY),
                                    ("use_local_output", KW, True))),
    Ref("RowwiseParallel", TENSOR, (("input_layouts", KW, ANY), ("output_layouts", KW, ANY),
                                    ("use_local_output", KW, True))),
    Ref("SequenceParallel", TENSOR), Ref("PrepareModuleInput", TENSOR), Ref("PrepareModuleOutput", TENSOR),
    Ref("PrepareModuleInputOutput", TENSOR), Ref("NoParallel", TENSOR),
    Ref("parallelize_module", TENSOR, (("module", POS, REQUIRED), ("device_mesh", POS, ANY),
                                       ("parallelize_plan", POS, ANY), ("src_data_rank", KW, 0))),
    # ---- pipeline
    Ref("PipelineStage", PIPE, (("module", POS, REQUIRED), ("stage_index", POS, REQUIRED),
                                ("stage_num", POS, REQUIRED))),
    Ref("Schedule1F1B", PIPE, (("?", POS, REQUIRED), ("micro_batch_num", POS, REQUIRED)),
        methods={"run": (("inputs", ARGS, REQUIRED), ("target", KW, None), ("losses", KW, None)), "step": ()}),
    Ref("ScheduleGPipe", PIPE, (("?", POS, REQUIRED), ("micro_batch_num", POS, REQUIRED)), methods={"run": ()}),
    Ref("ScheduleInterleaved1F1B", PIPE, (("stages", POS, REQUIRED), ("micro_batch_num", POS, REQUIRED),
                                          ("overlap_p2p", KW, False), ("overlap_b_f", KW, False)),
        methods={"run": ()}),
    Ref("MetaStep", PIPE, methods={"sub_steps": None}),
    Ref("MetaStepType", PIPE, members={"FORWARD": "F", "BACKWARD": "B", "OVERLAP_F_B": None, "OVERLAP_B_F": None,
                                       "FWD_RECV": None, "BWD_RECV": None, "FWD_SEND": None, "BWD_SEND": None}),
    Ref("BatchDimSpec", PIPE),
    # ---- context and expert parallel
    Ref("ContextParallel", P),
    Ref("ExpertParallel", P), Ref("ExpertTensorParallel", P),
    Ref("CommComputeOverlap", P, methods={
        "wrap_dispatch": (("dispatch_fn", POS, REQUIRED),),
        "wrap_combine": (("combine_fn", POS, REQUIRED), ("is_last_layer", POS, False)),
        "run": (("fwd_fn", POS, REQUIRED), ("bwd_fn", POS, REQUIRED))}),
    # ---- process groups and platform
    Ref("init_process_group", P, (("backend", POS, None),)),
    Ref("destroy_process_group", P),
    Ref("get_process_group_ranks", P, (("group", POS, ANY),)),
    Ref("get_backend", P),
    Ref("split_group", P, (("group", POS, ANY), ("split_size", POS, ANY))),
    Ref("get_group_local_rank", P, (("group", POS, ANY),)),
    Ref("mark_created_groups", P, (("groups", POS, REQUIRED),)),
    Ref("get_platform", "hyper_adaptor.platform", ()),
    # ---- memory
    Ref("checkpoint", M, (("function", POS, REQUIRED), ("args", ARGS, REQUIRED), ("swap_inputs", KW, False),
                          ("policy_fn", KW, None), ("context_fn", KW, None), ("group_swap", KW, False),
                          ("early_stop", KW, True), ("kwargs", KWARGS, REQUIRED))),
    Ref("swap", M, (("function", POS, REQUIRED), ("args", ARGS, REQUIRED), ("policy_fn", KW, None),
                    ("kwargs", KWARGS, REQUIRED))),
    Ref("checkpoint_wrapper", M, (("module", POS, REQUIRED), ("checkpoint_kwargs", KWARGS, REQUIRED))),
    Ref("checkpoint_exclude_wrapper", M, (("module", POS, REQUIRED), ("save_output", KW, True))),
    Ref("swap_wrapper", M, (("module", POS, REQUIRED), ("policy_fn", POS, None))),
    Ref("swap_tensor_wrapper", M, (("target", POS, REQUIRED), ("tag", POS, None))),
    Ref("CheckpointPolicy", M, members={"MUST_SAVE": 0, "PREFER_SAVE": 1, "MUST_RECOMPUTE": 2,
                                        "PREFER_RECOMPUTE": 3, "MUST_SWAP": 4}),
    Ref("SwapManager", M, methods={
        "set_forward_prefetch_layer": (("first_layer", POS, REQUIRED), ("second_layer", POS, REQUIRED)),
        "launch_offload": (("group_name", POS, REQUIRED), ("copy_stream", POS, None)),
        "wait_offload": (("group_name", POS, REQUIRED),),
        "launch_load": (("group_name", POS, REQUIRED), ("copy_stream", POS, None)),
        "wait_load": (("group_name", POS, REQUIRED),)}),
    # ---- optimizers
    Ref("AdamW", OPT, (("params", POS, REQUIRED), ("lr", POS, 1e-3), ("betas", POS, (0.9, 0.999)), ("eps", POS, 1e-8),
                     ("weight_decay", POS, 1e-2))),
    Ref("Muon", OPT, (("params", POS, REQUIRED), ("lr", POS, 0.02), ("momentum", POS, 0.95), ("ns_steps", KW, 5),
                    ("nesterov", KW, True), ("weight_decay", KW, 0.1))),
    Ref("ChainedOptimizer", OPT, (("model", POS, REQUIRED), ("optimizers", POS, ANY), ("flatten", POS, False)),
        methods={"step": (), "zero_grad": (("set_to_none", POS, True),), "__iter__": ()}),
    Ref("get_hyper_optimizer", OPT, (("model", POS, REQUIRED), ("muon_params", POS, ANY), ("adamw_params", POS, ANY),
                                   ("muon_kwargs", POS, None), ("adamw_kwargs", POS, None))),
]

ALIASES = [  # our earlier spellings, kept because this repository's code uses them
    Ref("MetaStepType", PIPE, members={"FWD": "F", "BWD": "B", "FWD_BWD": None, "SEND_F": None, "RECV_F": None,
                                       "SEND_B": None, "RECV_B": None}, status="alias"),
]

DIFFERS = [
    Ref("MetaStep", PIPE, status="differs", why="fields micro_index, step_type, stage_index, pair: a schedule "
        "here is one list per rank of steps naming their micro-batch and stage; sub_steps is a property"),
    Ref("HookRole", P, status="differs", why="members COMM and COMPUTE; values are lower case"),
    Ref("HookCoordinator", P, status="differs", why="rendezvous(role, side) instead of (hook_name, role)"),
]

NOT_SERVED = [
    Ref("HSDPCell", "", status="not served", why="a MindSpore nn.Cell; fully_shard / HSDPModule serve torch modules"),
    Ref("parallelize_value_and_grad", "", status="not served",
        why="MindSpore's functional value_and_grad; torch computes gradients with autograd"),
    Ref("DFunction", "", status="not served", why="HyperParallel's base for ops dispatched on its own Layout; torch "
        "DTensor dispatches through its sharding propagation (register_sharding for custom ops)"),
    Ref("SkipDTensorDispatch", "", status="not served",
        why="bypasses HyperParallel's own DTensor dispatcher; use DTensor.to_local / local_map with torch"),
    Ref("custom_shard", "", status="not served",
        why="MindSpore's function sharding by layouts; torch's counterpart is torch.distributed.tensor.experimental"
            ".local_map"),
    Ref("RaggedShard", "", status="not served", why="uneven shards are not a torch DTensor placement"),
    Ref("MC2Linear", "", status="not served", why="Ascend's fused matmul + collective (MC2) kernel"),
    Ref("MC2RowwiseParallel", "", status="not served", why="a RowwiseParallel over the Ascend MC2 kernel"),
    Ref("ScheduleMPipeTranspose", "", status="not served",
        why="MindSpore's pipeline transpose schedule; ScheduleZBV and schedule_from_actions take custom lists"),
    Ref("AsyncContextParallel", "", status="not served",
        why="ContextParallel's ring already overlaps its send/receive with the block attention"),
    *[Ref(n, "", status="not served", why="DeepSeek sparse attention (DSA) on Ascend's sparse attention kernels")
      for n in ("AsyncDSAIndexerContextParallel", "AsyncDSAIndexerLossContextParallel",
                "AsyncDSASparseAttentionContextParallel", "DSAIndexerContextParallel", "DSAIndexerLossContextParallel",
                "DSASparseAttentionContextParallel")],
    Ref("TensorParallel", "", status="not served",
        why="HyperParallel's expert-internal TP style; ExpertTensorParallel covers experts sharded by TP"),
]

ALL = SERVED + ALIASES + DIFFERS + NOT_SERVED


def _obj(ref: Ref):
    return getattr(importlib.import_module(ref.home), ref.name)


def _check_params(where: str, fn, spec) -> None:
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    by_name = {p.name: p for p in params}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    pos_index = 0
    for name, kind, default in spec:
        if kind == ARGS:
            assert any(p.kind is p.VAR_POSITIONAL for p in params), f"{where}: takes no *{name}"
            continue
        if kind == KWARGS:
            assert any(p.kind is p.VAR_KEYWORD for p in params), f"{where}: takes no **{name}"
            continue
        if name == "?":
            assert pos_index < len(positional), f"{where}: positional parameter {pos_index} missing"
            p = positional[pos_index]
        else:
            assert name in by_name, f"{where}: no parameter {name!r} (has {list(by_name)})"
            p = by_name[name]
        if kind == POS:
            assert p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD), f"{where}: {p.name} is not positional"
            assert positional.index(p) == pos_index, f"{where}: {p.name} is positional {positional.index(p)}, " \
                                                     f"the reference's {pos_index}"
            pos_index += 1
        else:
            assert p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD), f"{where}: {p.name} is not a keyword"
        # a parameter the reference requires may have a default here (a call that passes it still works)
        if default is not ANY and default is not REQUIRED:
            assert p.default == default, f"{where}: {p.name} defaults to {p.default!r}, the reference's {default!r}"


@pytest.mark.parametrize("ref", [r for r in ALL if r.status in ("served", "alias", "differs")],
                         ids=lambda r: f"{r.status}-{r.name}")
def test_name_is_exported_with_its_signature(ref):
    obj = _obj(ref)
    if ref.params:
        _check_params(ref.name, obj, ref.params)
    for method, spec in ref.methods.items():
        assert hasattr(obj, method), f"{ref.name} has no {method}"
        if spec:
            _check_params(f"{ref.name}.{method}", getattr(obj, method), spec)
    if ref.members is not None:
        assert issubclass(obj, enum.Enum)
        for member, value in ref.members.items():
            assert member in obj.__members__, f"{ref.name} has no member {member}"
            if value is not None:
                assert obj[member].value == value, f"{ref.name}.{member} = {obj[member].value!r}, reference {value!r}"


def test_aliases_name_the_reference_members():
    from hyper_adaptor.parallel.pipeline import MetaStepType as T

    assert T.FWD is T.FORWARD and T.BWD is T.BACKWARD and T.FWD_BWD is T.OVERLAP_F_B is T.OVERLAP_B_F
    assert (T.SEND_F, T.RECV_F, T.SEND_B, T.RECV_B) == (T.FWD_SEND, T.FWD_RECV, T.BWD_SEND, T.BWD_RECV)


@pytest.mark.parametrize("ref", [r for r in ALL if r.status == "not served"], ids=lambda r: r.name)
def test_not_served_names_are_absent_and_have_a_reason(ref):
    import hyper_adaptor.parallel as parallel

    assert ref.why, ref.name
    assert not hasattr(parallel, ref.name), f"{ref.name} is exported now: move it to SERVED"


def test_every_name_is_in_the_docs_table_with_its_status():
    text = DOC.read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and len(cells) >= 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[2]
    missing = sorted({r.name for r in ALL} - set(rows))
    assert not missing, f"not in the table of {DOC.name}: {missing}"
    for r in ALL:
        if r.status in ("not served", "differs"):
            assert rows[r.name].startswith(r.status), f"{DOC.name}: {r.name} is '{rows[r.name]}', not '{r.status}'"


SURFACES = {"hyper_adaptor.parallel": ("hsdp", "tensor", "context", "expert", "pipeline", "process_group"),
            "hyper_adaptor.memory": (), "hyper_adaptor.optim": ()}


def test_the_import_surface_re_exports_every_public_name():
    import hyper_adaptor.parallel as parallel

    for sub in SURFACES["hyper_adaptor.parallel"]:
        module = importlib.import_module(f"hyper_adaptor.parallel.{sub}")
        names = set(module.__all__) - {"hsdp"}   # the attribute hsdp of the package is the subpackage
        assert names <= set(parallel.__all__), f"{sub}: not re-exported {sorted(names - set(parallel.__all__))}"
        for n in names:
            assert getattr(parallel, n) is getattr(module, n), n
    for surface in ("hyper_adaptor.memory", "hyper_adaptor.optim"):
        module = importlib.import_module(surface)
        for n in module.__all__:
            assert hasattr(module, n), f"{surface}.__all__ names {n}, which is missing"
    for r in SERVED:
        if r.home in SURFACES:
            assert r.name in importlib.import_module(r.home).__all__, f"{r.name} not in {r.home}.__all__"


def test_the_surface_imports_light():
    import subprocess
    import sys

    code = "import sys, hyper_adaptor.parallel; print('torch.distributed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
