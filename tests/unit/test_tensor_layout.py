"""hyper_adaptor.parallel.tensor on one process: Layout -> torch placements, every bad-layout error,
meta-device creation and init_parameters against plain init, dropout's full-mask path."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hyper_adaptor.parallel import tensor as T
from hyper_adaptor.testing.world import free_port


@pytest.fixture(scope="module")
def world1():
    """A 1-rank gloo world (the mesh is built over the real world size)."""
    if dist.is_initialized():
        yield
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_layout_maps_axes_to_placements():
    layout = T.Layout((2, 4), ("dp", "tp"))
    assert layout("dp", "None").placements == (T.Shard(0), T.Replicate())
    assert layout("None", "tp").placements == (T.Replicate(), T.Shard(1))
    assert layout("tp", "dp").placements == (T.Shard(1), T.Shard(0))
    assert layout(None, ("dp", "tp")).placements == (T.Shard(1), T.Shard(1))
    assert layout().placements == (T.Replicate(), T.Replicate())
    assert layout("None", "None").placements == (T.Replicate(), T.Replicate())


@pytest.mark.parametrize("axes, message", [
    (("mp", "None"), "'mp'"),
    (("dp", "dp"), "'dp' is used twice"),
    ((("tp", "dp"), "None"), "must follow the mesh order"),
])
def test_bad_layouts_name_the_axis(axes, message):
    with pytest.raises(ValueError, match=message):
        T.Layout((2, 4), ("dp", "tp"))(*axes)


def test_mesh_argument_errors():
    with pytest.raises(ValueError, match="2 names but mesh_shape"):
        T.Layout((2, 2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match="unique"):
        T.Layout((2, 2), ("dp", "dp"))
    with pytest.raises(ValueError, match="rank_list has 3 ranks"):
        T.Layout((2, 2), ("dp", "tp"), rank_list=[0, 1, 2])
    with pytest.raises(TypeError, match="call it with the tensor's axes"):
        T.distribute_tensor(torch.ones(2), T.Layout((1,), ("dp",)))


def test_divisibility_names_axis_and_dim():
    layout = T.Layout((2, 4), ("dp", "tp"))
    layout("dp", "tp").check((4, 8))
    with pytest.raises(ValueError, match="dim 1 of size 6 is not divisible by layout axis 'tp' of size 4"):
        layout("dp", "tp").check((4, 6))
    with pytest.raises(ValueError, match="axis 'dpxtp' of size 8"):
        layout(("dp", "tp"), "None").check((12, 3))
    with pytest.raises(ValueError, match="2 entries but the tensor has 3 dims"):
        layout("dp", "tp").check((4, 8, 2))


def test_world_size_mismatch_is_an_error(world1):
    with pytest.raises(ValueError, match=r"holds 4 devices but the world has 1"):
        _ = T.Layout((2, 2), ("dp", "tp"))("dp", "None").mesh


def test_mesh_current_and_axis_size(world1):
    with pytest.raises(ValueError, match="'tp' is not in"):
        T.get_device_num_along_axis(T.init_device_mesh("cpu", (1,), ("dp",)), "tp")
    layout = T.Layout((1, 1), ("dp", "tp"))
    mesh = layout("dp", "None").mesh
    assert T.get_current_mesh() is mesh and T.get_device_num_along_axis(mesh, "tp") == 1
    x = torch.arange(6.0).reshape(2, 3)
    d = T.distribute_tensor(x, layout("dp", "None"))
    assert d.placements == (T.Shard(0), T.Replicate()) and torch.equal(d.full_tensor(), x)
    assert torch.equal(T.from_local(x, layout("dp", "None")).full_tensor(), x)
    assert T.ones(2, 4, layout=layout("None", "tp")).placements == (T.Replicate(), T.Shard(1))
    assert torch.equal(T.full((2, 2), 3.0, layout=layout()).full_tensor(), torch.full((2, 2), 3.0))
    assert not T.is_partial(d)


def test_dtensor_is_torchs_class_under_hyperparallels_name(world1):
    from torch.distributed.tensor import DTensor as TorchDTensor

    layout = T.Layout((1, 1), ("dp", "tp"))
    x = torch.arange(6.0).reshape(2, 3)
    d = T.DTensor.from_local(x, layout("dp", "None"))   # HyperParallel's spelling: a layout, no placements
    assert type(d) is TorchDTensor and isinstance(d, T.DTensor) and issubclass(TorchDTensor, T.DTensor)
    assert d.placements == (T.Shard(0), T.Replicate()) and torch.equal(d.full_tensor(), x)
    assert not isinstance(x, T.DTensor) and not T.DTensor.is_partial(d)
    same = T.DTensor.from_local(x, d.device_mesh, d.placements)  # torch's spelling still works
    assert same.placements == d.placements
    with pytest.raises(ValueError, match="carries its placements"):
        T.DTensor.from_local(x, layout("dp", "None"), [T.Replicate(), T.Replicate()])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.fc = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("table", torch.arange(4.0))


def test_init_parameters_equals_plain_init(world1):
    torch.manual_seed(5)
    plain = Net()
    with T.init_empty_weights():
        lazy = Net()
    assert all(p.is_meta for p in lazy.parameters()) and not lazy.table.is_meta
    mesh = T.init_device_mesh("cpu", (1,), ("tp",))
    T.shard_module(lazy, {"fc.weight": T.Layout((1,), ("tp",))("tp", "None")})
    assert isinstance(lazy.fc.weight, T.DTensor) and isinstance(lazy.emb.weight, T.DTensor)
    T.init_parameters(lazy, seed=5)
    for (name, a), b in zip(plain.named_parameters(), lazy.parameters()):
        assert torch.equal(a, b.full_tensor()), name
    assert mesh.ndim == 1


def test_init_on_device_moves_buffers_too():
    with T.init_on_device("meta"):
        m = Net()
    assert m.table.is_meta and m.fc.weight.is_meta
    with T.init_empty_weights(include_buffers=True):
        assert Net().table.is_meta
    assert not Net().fc.weight.is_meta  # the patch ends with the block


def test_init_parameters_refuses_unknown_init():
    class Raw(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

    with T.init_empty_weights():
        m = nn.Sequential(Raw())
    with pytest.raises(ValueError, match="'0.w'.*no reset_parameters"):
        T.init_parameters(m)


def test_shard_module_keeps_tied_parameters_tied(world1):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(4, 2)
            self.head = nn.Linear(2, 4, bias=False)
            self.head.weight = self.emb.weight

    m = T.shard_module(Tied(), {"emb.weight": T.Layout((1,), ("tp",), rank_list=[0])("tp", "None")})
    assert isinstance(m.head.weight, T.DTensor) and m.head.weight is m.emb.weight


def test_shard_module_pattern_must_match(world1):
    layout = T.Layout((1,), ("tp",))
    with pytest.raises(ValueError, match="pattern 'nope.\\*' matches no parameter"):
        T.shard_module(Net(), {"nope.*": layout("tp", "None")})


def test_sharded_dropout_mask_equals_plain_dropout(world1):
    mesh = T.init_device_mesh("cpu", (1,), ("tp",))
    x = torch.randn(4, 6, 5)
    torch.manual_seed(3)
    ref = F.dropout(x, 0.3, True)
    torch.manual_seed(3)
    got = T._random.dropout(T.distribute_tensor(x, mesh, [T.Shard(1)]), 0.3, True)
    assert torch.equal(got.full_tensor(), ref)


def test_parallelize_module_checks(world1):
    mesh = T.init_device_mesh("cpu", (1,), ("tp",))
    with pytest.raises(ValueError, match="plan key 'mlp.fc9' matches no submodule"):
        T.parallelize_module(nn.Sequential(nn.Linear(2, 2)), mesh, {"mlp.fc9": T.ColwiseParallel()})
    mesh2 = T.init_device_mesh("cpu", (1, 1), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"1-D.*\('dp', 'tp'\)"):
        T.parallelize_module(nn.Linear(2, 2), mesh2, {})
