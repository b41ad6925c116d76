"""Live torch objects to checkpoint groups and back, bit for bit.

A resumed run must continue exactly where the old process would have, so what gets restored is not
"the weights" but everything an optimizer step reads: parameters, buffers, every optimizer state tensor
at its own dtype (AdamW's `step` is a float32 tensor, and restoring it as a Python int would change the
bias correction's rounding), and the param-group hyper-parameters the LR schedule last wrote.

Optimizer state is keyed by parameter *name* (`state.<param name>.<field>`), not by torch's positional
index, so a checkpoint cannot silently land on the wrong parameter when the model's parameter order or
grouping differs; restoring checks that every group holds exactly the parameters it held when saved.
Non-tensor values go into the JSON-able meta, which the checkpoint store keeps in its manifest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from rewind.engine.model.optimizer import AdamW
from rewind.engine.model.placement import full_tensor, like_parameter

_STATE = "state."
_GROUP = "group."
_MAX_NAMES_SHOWN = 5


class TensorFitError(Exception):
    """A checkpoint's tensors do not fit the live model or optimizer they are being loaded into."""


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict (parameters and persistent buffers) as detached, contiguous CPU copies."""
    tensors = {}
    for key, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            raise TensorFitError(
                f"model state {key!r} is a {type(value).__name__}; checkpoints hold only tensors"
            )
        tensors[key] = cpu_copy(value)
    return tensors


def load_model_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy `tensors` into the model in place (parameters keep their identity, so an optimizer built on
    them stays valid). Every key must match, with the same shape and dtype: no silent casts."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise TensorFitError(
            f"checkpoint does not fit the model: missing {_few(missing)}, unexpected {_few(unexpected)}"
        )
    for key, target in expected.items():
        given = tensors[key]
        if given.shape != target.shape or given.dtype != target.dtype:
            raise TensorFitError(
                f"checkpoint tensor {key} is {given.dtype} {list(given.shape)}, "
                f"the model's is {target.dtype} {list(target.shape)}"
            )
    model.load_state_dict(dict(tensors), strict=True)


def optimizer_tensors(
    optimizer: AdamW | torch.optim.Optimizer, param_names: Mapping[nn.Parameter, str]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, meta): state tensors as `state.<param>.<field>`, tensor-valued hyper-parameters as
    `group.<index>.<key>`; meta holds the class, each group's parameter names and other hyper-parameters,
    and any non-tensor per-parameter state."""
    tensors: dict[str, torch.Tensor] = {}
    groups_meta: list[dict[str, Any]] = []
    state_scalars: dict[str, dict[str, Any]] = {}
    seen: set[str] = set()
    for index, group in enumerate(optimizer.param_groups):
        names = []
        for parameter in group["params"]:
            name = param_names.get(parameter)
            if name is None:
                raise TensorFitError(
                    f"optimizer group {index} holds a parameter that param_names does not name"
                )
            if name in seen:
                raise TensorFitError(f"param_names gives the name {name!r} to two optimizer parameters")
            seen.add(name)
            names.append(name)
            for field, value in optimizer.state.get(parameter, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{_STATE}{name}.{field}"] = cpu_copy(value)
                else:
                    state_scalars.setdefault(name, {})[field] = value
        group_meta: dict[str, Any] = {"params": names}
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, torch.Tensor):  # e.g. a tensor lr for capturable optimizers
                tensors[f"{_GROUP}{index}.{key}"] = cpu_copy(value)
            else:
                group_meta[key] = value
        groups_meta.append(group_meta)
    meta = {"class": type(optimizer).__name__, "param_groups": groups_meta, "state_scalars": state_scalars}
    return tensors, meta


def load_optimizer_tensors(
    optimizer: AdamW | torch.optim.Optimizer,
    param_names: Mapping[nn.Parameter, str],
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
) -> None:
    """Restore what `optimizer_tensors` saved into an optimizer over the same named parameters."""
    if meta.get("class") != type(optimizer).__name__:
        raise TensorFitError(
            f"checkpoint holds a {meta.get('class')} state, the optimizer is a {type(optimizer).__name__}"
        )
    saved_groups = meta.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups):
        raise TensorFitError(
            f"checkpoint has {len(saved_groups)} optimizer groups, the optimizer {len(optimizer.param_groups)}"
        )
    # torch's optimizer state_dict numbers parameters across groups in order; build that numbering
    # from the live optimizer, after checking it holds the same names in the same places.
    index_of: dict[str, int] = {}
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    groups = []
    for index, (live, saved) in enumerate(zip(optimizer.param_groups, saved_groups, strict=True)):
        names = [param_names.get(parameter, "?") for parameter in live["params"]]
        if names != saved["params"]:
            raise TensorFitError(
                f"optimizer group {index} holds {_few(names)}, the checkpoint's held {_few(saved['params'])}"
            )
        group = {key: _like(live.get(key), value) for key, value in saved.items() if key != "params"}
        group["params"] = list(range(len(index_of), len(index_of) + len(names)))
        index_of.update(zip(names, group["params"], strict=True))
        groups.append(group)
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        # Field names never contain dots, parameter names do: split at the last one. Copies, so the
        # optimizer never shares storage with the caller's tensors.
        owner, _, field = key.rpartition(".")
        if key.startswith(_GROUP) and owner.removeprefix(_GROUP) in {str(i) for i in range(len(groups))}:
            groups[int(owner.removeprefix(_GROUP))][field] = tensor.clone()
        elif key.startswith(_STATE) and owner.removeprefix(_STATE) in index_of:
            index = index_of[owner.removeprefix(_STATE)]
            # A sharded parameter's moments are sharded like it: each rank keeps its slice of the whole.
            state.setdefault(index, {})[field] = like_parameter(tensor.clone(), parameters[index])
        else:
            raise TensorFitError(
                f"checkpoint optimizer tensor {key!r} fits no parameter or group of this optimizer"
            )
    for name, fields in meta.get("state_scalars", {}).items():
        if name not in index_of:
            raise TensorFitError(
                f"checkpoint optimizer state names {name!r}, not a parameter of this optimizer"
            )
        state.setdefault(index_of[name], {}).update(fields)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    # One copy whatever the source device or strides; same dtype, so the bits are unchanged. A shard is
    # made whole first (a collective: every rank copies the same tensors in the same order).
    tensor = full_tensor(tensor)
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    copy.copy_(tensor.detach())
    return copy


def _like(live: Any, saved: Any) -> Any:
    # JSON has no tuples: give a hyper-parameter back the tuple type it has in the live optimizer
    # (AdamW's betas), so the restored param_groups compare equal to the uninterrupted run's.
    if isinstance(live, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:_MAX_NAMES_SHOWN])
    return shown + (f" and {len(names) - _MAX_NAMES_SHOWN} more" if len(names) > _MAX_NAMES_SHOWN else "")
