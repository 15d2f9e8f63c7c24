"""A model built on the meta device from its config: the one implementation behind dtype conversion
(:mod:`dduf_plus.packing.convert`: the module tree names the tensors and says which stay in fp32) and
quanto loading (:mod:`dduf_plus.loading.quant`: the skeleton whose layers quanto's replace).

Why on the packing floor: both callers need it and layers point down only (packing < loading), so the
shared helper lives on the lower of the two floors; ``loading`` imports it, ``packing`` never imports
``loading``. It is not in ``format`` because it builds models (torch, accelerate, diffusers, transformers),
which the byte-only floors never do. Those are imported when a model is built, not with this module, so
importing ``dduf_plus.packing`` stays cheap."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import DDUFLoadError

if TYPE_CHECKING:  # pragma: no cover
    import torch


def is_diffusers_model(cls: object) -> bool:
    """Whether ``cls`` is a diffusers ``ModelMixin`` class (built with ``from_config``)."""
    try:
        from diffusers import ModelMixin
    except ImportError:  # pragma: no cover
        return False
    return isinstance(cls, type) and issubclass(cls, ModelMixin)


def meta_model(cls: type[Any], config: Mapping[str, Any], where: str) -> torch.nn.Module | None:
    """``cls`` built from ``config`` with its parameters on the meta device (no memory).

    Buffers stay real: non-persistent ones (position ids, say) are in no archive and must exist.
    ``quantization_config`` is dropped: the skeleton is the plain module tree, as ``from_pretrained``
    builds it before a quantizer rewrites it. A diffusers model is built with ``from_config``, a
    transformers one from its ``config_class``; any other class gives None.

    Raises:
        DDUFLoadError: the model code refused the config (it can raise anything; the message names
            ``where`` and the class).
    """
    from accelerate import init_empty_weights

    config = {k: v for k, v in config.items() if k != "quantization_config"}
    try:
        with init_empty_weights(include_buffers=False):
            if is_diffusers_model(cls):
                return cls.from_config(config)
            config_class = getattr(cls, "config_class", None)
            if config_class is None:
                return None
            return cls(config_class.from_dict(config))
    except Exception as e:  # arbitrary model code, arbitrary config
        raise DDUFLoadError(f"{where}: cannot build {cls.__name__} from its config: {e}") from e
