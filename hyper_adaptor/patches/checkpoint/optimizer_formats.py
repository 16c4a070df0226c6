"""Optimizer state that moves between megatron's distributed optimizer and the per-parameter optimizers
(megatron's plain ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params``, which HSDP runs on).

Both write their tensors in model space under the same keys (``optimizer.state.exp_avg.<param key>``), so
the moments themselves need no conversion; megatron-core 0.19.2 still cannot load one's checkpoint into the
other, for three reasons this module answers at the smallest seams:

* **main-parameter keys.** The distributed optimizer's fully-reshardable format stores the fp32 main
  parameters as ``optimizer.state.param.<key>``; ``Float16OptimizerWithFloat16Params`` as
  ``optimizer.state.fp32_param.<key>``; ``FP32Optimizer`` not at all (its main parameter *is* the model's
  weight, ``<key>``). A wrap of ``dist_checkpointing.load`` renames a requested main-parameter key that the
  checkpoint lacks to the one it holds (and only then: a checkpoint of the same kind is untouched).
* **the non-tensor part.** The distributed optimizer keeps ``{"optimizer": {"param_groups": [...]},
  "param_state_sharding_type": ...}`` with the step in each group; the plain optimizers keep torch's
  ``{"state", "param_groups"}`` (nested under ``"optimizer"`` for Float16) with a ``common_step``. Wraps of
  the three ``load_state_dict`` methods rebuild the structure each expects (groups are matched by their
  configuration, as megatron matches them; parameters by this optimizer's own order).
* **a fresh distributed optimizer on torch's Adam (no apex, no Transformer Engine).** Loading asks the
  optimizer for its state dict first, and megatron reads the step from the per-parameter state, which a
  fresh torch optimizer does not have yet (``assert len(steps) == 1``, any layout, any device): the wrap of
  ``sharded_state_dict`` creates that state (zeros, step 0) before a load, as megatron does for its plain
  optimizers; the load then overwrites all of it. Megatron then copies every tensor of a parameter's state
  from the checkpoint, torch's ``step`` tensor included, which the fully-reshardable checkpoint keeps per
  group (``KeyError: 'step'``) and the default (dp_reshardable) one per parameter, where it does not read
  back right (a resume at the same layout was off from its second step: grad norm 0.875 against 0.870):
  the wrap of ``_set_main_param_and_optimizer_states`` always leaves the step to the group's value, and
  runs it under ``no_grad`` (its default-format caller does not, and the copy into an fp32 main parameter,
  a view of a leaf that requires grad, raises).
  And that value is ONE tensor given to every parameter's state, which torch's Adam then increments in
  place once per parameter: after a resume the bias correction ran on a step count of hundreds (weights
  4e-4 off the uninterrupted run after one step, the Adam moments equal). The wrap of ``load_state_dict``
  gives each parameter its own copy.
* **the format a plain checkpoint is read in.** Its content metadata names no distributed-optimizer
  format; the wrap of ``load_content_metadata`` asks the distributed optimizer for its fully-reshardable
  (model-space) one, which is what a per-parameter checkpoint is.
"""

from __future__ import annotations

import functools
import os

import torch

from hyper_adaptor.patch_manager import Patch

FEATURE = "checkpoint"
OPTIMIZER = "megatron.core.optimizer.optimizer"
DISTRIB = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
# a requested main-parameter key the checkpoint lacks -> the keys that hold the same tensor elsewhere
_MAIN_PARAM = {"optimizer.state.param.": ("optimizer.state.fp32_param.", ""),
               "optimizer.state.fp32_param.": ("optimizer.state.param.",)}


def checkpoint_keys(checkpoint_dir) -> set[str] | None:
    """The tensor keys of a torch_dist checkpoint, from its DCP metadata only (None: not one)."""
    if not os.path.isfile(os.path.join(str(checkpoint_dir), ".metadata")):
        return None
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata)


def alias_for(key: str, present: set[str]) -> str | None:
    """The key holding ``key``'s main parameter in a checkpoint of the other optimizer kind, or None."""
    if key in present:
        return None
    for prefix, others in _MAIN_PARAM.items():
        if key.startswith(prefix):
            name = key[len(prefix):]
            for other in others:
                if other + name in present:
                    return other + name
    return None


def _wrap_load(original):
    @functools.wraps(original)
    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        present = checkpoint_keys(checkpoint_dir)
        if present is not None:
            from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
            from megatron.core.dist_checkpointing.mapping import (
                LocalNonpersistentObject,
                ShardedTensor,
                ShardedTensorFactory,
            )

            def rename(item):
                if isinstance(item, (ShardedTensor, ShardedTensorFactory)):
                    other = alias_for(item.key, present)
                    if other is not None and other.startswith("optimizer."):
                        item.key = other
                    elif other is not None:
                        # an fp32 checkpoint of a plain optimizer: the main parameter IS the model's
                        # weight, which the model's own request loads (asking twice is an overlap error)
                        # and which the distributed optimizer's fp32 shards are views of
                        return LocalNonpersistentObject(None)
                return item

            dict_list_map_inplace(rename, sharded_state_dict)
        return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)

    return load


def _wrap_content_metadata(original):
    @functools.wraps(original)
    def load_content_metadata(*args, **kwargs):
        metadata = original(*args, **kwargs)
        from megatron.training import get_args

        if get_args().use_distributed_optimizer and "distrib_optim_sharding_type" not in (metadata or {}):
            # a checkpoint of a per-parameter optimizer (plain, HSDP) holds its state in model space
            metadata = dict(metadata or {}, distrib_optim_sharding_type="fully_reshardable")
        return metadata

    return load_content_metadata


def _step_value(step):
    return float(step.item() if isinstance(step, torch.Tensor) else step)


def _identifier(group: dict) -> tuple:
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group.get(k, group.get(f"pre_{k}")) for k in param_group_identifier_keys)


def plain_groups(saved_groups: list, inner) -> tuple[list, float | None]:
    """Saved groups (a distributed optimizer's: no params, a step each; or several optimizers' groups put
    together) as this plain optimizer's: its own groups in its own order, each with its own parameter ids
    and the configuration of the saved group that has the same identifying keys, as megatron matches them."""
    saved = {_identifier(g): g for g in saved_groups}
    groups = []
    for mine, live in zip(inner.state_dict()["param_groups"], inner.param_groups):
        key = _identifier(live)
        if key not in saved:
            raise ValueError(f"the checkpoint's optimizer has no parameter group configured as this run's {key} "
                             f"(it has {sorted(map(str, saved))})")
        groups.append({**{k: v for k, v in saved[key].items() if k not in ("step", "params")},
                       "params": mine["params"]})
    steps = {g["step"] for g in saved_groups if "step" in g}
    return groups, (_step_value(next(iter(steps))) if steps else None)


def _from_distributed(state: dict, inner) -> None:
    """``state`` (torch's optimizer dict, loaded tensors in ``state``) fed from a distributed-optimizer
    checkpoint's groups: in place."""
    groups, step = plain_groups(state["param_groups"], inner)
    state["param_groups"] = groups
    if step is not None:
        state["state"]["common_step"] = torch.tensor(step, dtype=torch.float32)


def _wrap_fp32_load(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        if "param_state_sharding_type" in state_dict:  # saved by the distributed optimizer
            saved = state_dict.pop("optimizer")
            state_dict.pop("param_state_sharding_type")
            state_dict.pop("param_state", None)
            state_dict["param_groups"] = saved["param_groups"]
            state_dict.setdefault("state", {})
            _from_distributed(state_dict, self.optimizer)
        return original(self, state_dict)

    return load_state_dict


def _wrap_float16_load(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        if "param_state_sharding_type" in state_dict:
            state_dict.pop("param_state_sharding_type")
            state_dict.pop("param_state", None)
            state_dict["optimizer"].setdefault("state", {})
            _from_distributed(state_dict["optimizer"], self.optimizer)
        return original(self, state_dict)

    return load_state_dict


def _wrap_distributed_load(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        if "param_state" in state_dict and "param_state_sharding_type" not in state_dict:
            # saved by a per-parameter optimizer: FP32Optimizer's torch dict at the top, Float16's under
            # "optimizer"; its groups carry parameter ids and the step is common_step
            torch_dict = state_dict.get("optimizer", state_dict)
            common = torch_dict.get("state", {}).get("common_step")
            groups = [{k: v for k, v in g.items() if k != "params"} for g in torch_dict["param_groups"]]
            if common is not None:
                for group in groups:
                    group["step"] = _step_value(common)
            state_dict = {"optimizer": {"param_groups": groups}, "param_state": state_dict["param_state"],
                          "param_state_sharding_type": "fully_reshardable",
                          **({"grad_scaler": state_dict["grad_scaler"]} if "grad_scaler" in state_dict else {})}
        for entry in (state_dict.get("param_state") or {}).values():
            if isinstance(entry, dict):
                for key in [k for k, v in entry.items() if v is None]:
                    del entry[key]
        result = original(self, state_dict)
        inner = self.optimizer
        if isinstance(inner, torch.optim.Optimizer):
            for state in inner.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()  # one counter per parameter, as torch keeps them
        return result

    return load_state_dict


def _wrap_distributed_sharded_state_dict(original):
    @functools.wraps(original)
    def sharded_state_dict(self, *args, **kwargs):
        from megatron.core.optimizer import distrib_optimizer

        is_loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
        inner = self.optimizer
        if is_loading and not distrib_optimizer.HAVE_APEX_OR_TE and isinstance(inner, torch.optim.Optimizer) \
                and len(inner.state) == 0:
            if self.init_state_fn is not None:
                self.init_state_fn(inner, self.config)
            for group in inner.param_groups:
                for param in group["params"]:
                    inner.state[param].setdefault("step", torch.tensor(0.0))
        return original(self, *args, **kwargs)

    return sharded_state_dict


def _merged(parts: list, loaded: dict) -> dict:
    """Several optimizers' saved non-tensor parts as one optimizer's, with the tensors ``loaded`` for it."""
    if all("param_state_sharding_type" in p for p in parts):
        groups = [g for p in parts for g in p["optimizer"]["param_groups"]]
        return {"optimizer": {"param_groups": groups},
                "param_state_sharding_type": parts[0]["param_state_sharding_type"], **loaded}
    torch_dicts = [p.get("optimizer", p) for p in parts]
    groups = [g for t in torch_dicts for g in t["param_groups"]]
    steps = [t.get("state", {}).get("common_step") for t in torch_dicts]
    merged = {"param_groups": groups, "state": dict(loaded.get("state", {}))}
    if any(step is not None for step in steps):
        merged["state"]["common_step"] = next(step for step in steps if step is not None)
    if "optimizer" in parts[0]:  # Float16: the torch dict sits under "optimizer"
        merged = {**{k: v for k, v in loaded.items() if k not in ("state", "optimizer")},
                  "optimizer": {**merged, "state": {**loaded.get("optimizer", {}).get("state", {}),
                                                    **{k: v for k, v in merged["state"].items()}}}}
    return merged


def _wrap_chained_load(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        count = len(self.chained_optimizers)
        parts = sorted(k for k in state_dict if isinstance(k, int))
        rest = {k: v for k, v in state_dict.items() if not isinstance(k, int)}
        if count == 1 and len(parts) > 1:
            # saved by several optimizers (e.g. dense and expert-parallel ones at EP > 1), read by one
            return original(self, _merged([state_dict[k] for k in parts], rest))
        if count > 1 and parts == list(range(count)) and rest:
            # saved by one optimizer, read by several: each takes its groups from the whole
            return original(self, {k: {**rest, **state_dict[k]} for k in parts})
        return original(self, state_dict)

    return load_state_dict


def _wrap_set_states(original):
    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        # None: megatron skips what is not a tensor. The step was set from the groups already (and wins over
        # a per-parameter one); an fp32 main parameter not read from the checkpoint (see _wrap_load) is the
        # model's weight, loaded
        tensors = {"param": None, **tensors, "step": None}
        # megatron's dp_reshardable loader calls this outside no_grad, and the fp32 main parameters are
        # views of leaves that require grad: copy_ into them raises ("a view of a leaf Variable ...")
        with torch.no_grad():
            return original(self, model_param, tensors)

    return _set_main_param_and_optimizer_states


def patches(args) -> list[Patch]:
    if not getattr(args, "load", None):
        return []
    return [
        Patch("megatron.core.dist_checkpointing.load", _wrap_load, "wrap", FEATURE),
        Patch("megatron.core.dist_checkpointing.load_content_metadata", _wrap_content_metadata, "wrap", FEATURE),
        # outermost: HSDP's wraps of these turn the loaded rows into DTensors of a plain optimizer's dict
        Patch(f"{OPTIMIZER}.FP32Optimizer.load_state_dict", _wrap_fp32_load, "wrap", FEATURE, after=("hsdp",)),
        Patch(f"{OPTIMIZER}.Float16OptimizerWithFloat16Params.load_state_dict", _wrap_float16_load, "wrap",
              FEATURE, after=("hsdp",)),
        Patch(f"{DISTRIB}.load_state_dict", _wrap_distributed_load, "wrap", FEATURE),
        Patch(f"{OPTIMIZER}.ChainedOptimizer.load_state_dict", _wrap_chained_load, "wrap", FEATURE),
        Patch(f"{DISTRIB}.sharded_state_dict", _wrap_distributed_sharded_state_dict, "wrap", FEATURE),
        Patch(f"{DISTRIB}._set_main_param_and_optimizer_states", _wrap_set_states, "wrap", FEATURE),
    ]
