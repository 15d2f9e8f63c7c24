"""Give a model built on the meta device its tensors: what ``load_state_dict(state, assign=True)`` does, in one
pass over a name table instead of torch's recursive walk (which calls each module's hooks and
``_load_from_state_dict``: about 25 ms of a warm SD-1.5-shaped load for ~1,100 tensors).

Taken only where the two are the same: every module uses ``nn.Module``'s own ``_load_from_state_dict`` and has
no state-dict hooks, and every stored tensor has the shape of the one it replaces. Anything else (a shape that
does not fit, a module with its own loading) returns ``None`` and the caller uses ``load_state_dict``, whose
errors and hooks then apply unchanged."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

from ..torchkit.empty_init import registration_hooks_idle

if TYPE_CHECKING:  # pragma: no cover
    import torch


class Assigned(NamedTuple):
    """What :func:`assign_state` did: ``load_state_dict``'s two lists, and what the same pass saw left over."""

    missing_keys: list[str]
    unexpected_keys: list[str]
    still_meta: list[str]  # parameters and buffers (non-persistent ones too) still on the meta device


def assign_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *,
                 mark: str | None = None) -> Assigned | None:
    """Assign ``state``'s tensors to ``model``'s parameters and persistent buffers, as
    ``load_state_dict(state, strict=False, assign=True)``; returns the missing and unexpected keys (and what
    is still on the meta device), or None (nothing assigned) where that call could behave otherwise.
    ``mark``: an attribute set to True on every tensor assigned (transformers' ``_is_hf_initialized``)."""
    import torch
    if not registration_hooks_idle():
        return None  # setattr would call them; a direct assignment would not
    base, extra = torch.nn.Module._load_from_state_dict, torch.nn.Module.get_extra_state
    slots: dict[str, tuple[torch.nn.Module, str, bool]] = {}  # state name -> (module, attribute, is parameter)
    meta_unsaved: list[str] = []  # non-persistent buffers on the meta device: no state can fill them
    for prefix, module in model.named_modules(remove_duplicate=False):
        if (type(module)._load_from_state_dict is not base or type(module).get_extra_state is not extra
                or module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks):
            return None
        dot = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None:
                slots[dot + name] = (module, name, True)
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                slots[dot + name] = (module, name, False)
            elif buf is not None and buf.is_meta:
                meta_unsaved.append(dot + name)
    plan = []
    for key, tensor in state.items():
        slot = slots.get(key)
        if slot is None:
            continue
        module, name, is_param = slot
        current = module._parameters[name] if is_param else module._buffers[name]
        if current is None or not isinstance(tensor, torch.Tensor) or current.shape != tensor.shape:
            return None  # load_state_dict reports it (size mismatch) in its own words
        plan.append((module, name, is_param, current, tensor))
    for module, name, is_param, current, tensor in plan:
        if is_param:
            tensor = module._parameters[name] = torch.nn.Parameter(tensor, requires_grad=current.requires_grad)
        else:
            module._buffers[name] = tensor
        if mark is not None:
            setattr(tensor, mark, True)
    unexpected = [key for key in state if key not in slots]
    missing = [key for key in slots if key not in state]
    still_meta = [key for key in missing if _slot_tensor(slots[key]).is_meta] + meta_unsaved
    return Assigned(missing, unexpected, still_meta)


def _slot_tensor(slot: tuple[torch.nn.Module, str, bool]) -> torch.Tensor:
    module, name, is_param = slot
    tensor = module._parameters[name] if is_param else module._buffers[name]
    assert tensor is not None  # slots hold only registered tensors
    return tensor
