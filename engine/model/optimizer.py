"""The run's AdamW: torch's own single-tensor Adam arithmetic, driven without `torch.optim.Optimizer`.

Why not `torch.optim.AdamW` itself: every method of torch's Optimizer base (`add_param_group` in its
constructor, `zero_grad`, `step`) imports `torch._dynamo` on first use, which costs about as much as
`import torch` again, and a restart pays it before its first step. The update itself is not rewritten
here: `step` hands the same lists and settings to `torch.optim.adam.adam`, the functional that
`torch.optim.AdamW.step` calls (with `foreach=False`, the single-tensor path), so every bit is torch's.
`tests/engine/test_optimizer.py` holds it to torch's AdamW over steps, groups, LR changes, cleared
state and restored state.

What the rest of rewind relies on is the part of torch's Optimizer interface it uses: `param_groups`
(dicts with torch's keys in torch's order, so a checkpoint's recorded settings and its name are as
before), `state` (parameter -> {"step", "exp_avg", "exp_avg_sq"}), `step()`, `zero_grad()` and
`load_state_dict()` with torch's casting rules. The class is named AdamW: checkpoints record the class
name, and those of earlier releases say "AdamW".
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim.adam import adam


class AdamW:
    """AdamW (decoupled weight decay) over parameter groups, as `torch.optim.AdamW(..., foreach=False)`."""

    def __init__(
        self,
        groups: Iterable[Mapping[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float = 1e-2,
    ) -> None:
        # torch's AdamW defaults, in torch's order: a group is its own keys, then these.
        self.defaults: dict[str, Any] = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": False,
            "maximize": False,
            "foreach": False,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
        }
        self.state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        self.param_groups: list[dict[str, Any]] = []
        seen: set[int] = set()
        for given in groups:
            group = dict(given)
            group["params"] = list(group["params"])
            for parameter in group["params"]:
                if id(parameter) in seen:
                    raise ValueError("a parameter appears in more than one optimizer group")
                seen.add(id(parameter))
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            self.param_groups.append(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:
            raise ValueError("rewind's AdamW only drops gradients (set_to_none=True)")
        for group in self.param_groups:
            for parameter in group["params"]:
                parameter.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient (state created on its first update)."""
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                if parameter.grad.is_sparse:
                    raise RuntimeError("AdamW does not take sparse gradients")
                state = self.state[parameter]
                if not state:  # as torch: the step count a float CPU scalar, the moments like the parameter
                    state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                    state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
                params.append(parameter)
                grads.append(parameter.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            beta1, beta2 = group["betas"]
            adam(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                steps,
                foreach=False,
                capturable=False,
                differentiable=False,
                fused=False,
                grad_scale=None,
                found_inf=None,
                has_complex=any(torch.is_complex(p) for p in params),
                decoupled_weight_decay=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore torch's state_dict form ({"state": {index: fields}, "param_groups": [...]}, parameters
        numbered across groups in order), cast as torch casts it: `step` kept as saved, every other
        floating state tensor to its parameter's dtype and device."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("the state holds another number of parameter groups")
        parameters = [parameter for group in self.param_groups for parameter in group["params"]]
        groups = []
        for live, saved in zip(self.param_groups, saved_groups, strict=True):
            if len(saved["params"]) != len(live["params"]):
                raise ValueError("a saved group holds another number of parameters")
            group = {key: value for key, value in saved.items() if key != "params"}
            group["params"] = live["params"]  # after the saved keys, as torch's load_state_dict
            for key, default in _SETSTATE_DEFAULTS:  # then torch's Adam.__setstate__, in its order
                group.setdefault(key, default)
            group["decoupled_weight_decay"] = True  # as torch's AdamW.__setstate__
            if unused := [key for key in _UNUSED if group[key]]:
                raise ValueError(
                    f"the state's optimizer uses {', '.join(unused)}, which rewind's AdamW does not"
                )
            groups.append(group)
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for index, fields in state_dict["state"].items():
            parameter = parameters[int(index)]
            state[parameter] = {key: _cast(key, value, parameter) for key, value in fields.items()}
            if "step" in fields and not isinstance(fields["step"], torch.Tensor):  # as torch's __setstate__
                state[parameter]["step"] = torch.tensor(float(fields["step"]), dtype=_scalar_dtype())
        self.param_groups = groups
        self.state = state


# Keys torch's Adam.__setstate__ gives a restored group that lacks them, in its order; and the settings
# whose arithmetic is not the single-tensor path this class runs.
_SETSTATE_DEFAULTS = (
    ("amsgrad", False),
    ("maximize", False),
    ("foreach", None),
    ("capturable", False),
    ("differentiable", False),
    ("decoupled_weight_decay", False),
    ("fused", None),
)
_UNUSED = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused")


def _cast(key: str, value: Any, parameter: torch.Tensor) -> Any:
    if not isinstance(value, torch.Tensor) or key == "step":
        return value
    if parameter.is_floating_point():
        return value.to(dtype=parameter.dtype, device=parameter.device)
    return value.to(device=parameter.device)


def _scalar_dtype() -> torch.dtype:
    # torch's _get_scalar_dtype(): the step count is float64 only under a float64 default dtype.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
