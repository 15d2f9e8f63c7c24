"""Find the class of each pipeline component as diffusers does (``[library, class]`` in model_index.json)
and build it with the loader its kind needs: models (``models.py``), schedulers and other diffusers
configs (``from_config``), tokenizers and processors (transformers ``from_pretrained`` over the component's
small files)."""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

from ..errors import DDUFError, DDUFLoadError
from ..format.tokenizer_budget import config_number_problem
from .files import ComponentFiles
from .models import ModelRequest, build_diffusers_model, build_transformers_model

logger = logging.getLogger(__name__)

# Libraries whose components load_dduf builds (diffusers' own list, less ONNX runtime training).
KNOWN_LIBRARIES = ("diffusers", "transformers")
_INSTALL = {"transformers": "transformers", "diffusers": "diffusers"}


def resolve_class(component: str, library: str, class_name: str) -> type[Any]:
    """The class ``[library, class_name]`` names, found where diffusers looks: ``diffusers``,
    ``transformers``, a pipeline module of diffusers (``["stable_diffusion", "StableDiffusionSafetyChecker"]``),
    or a module the caller has already imported (the archive never makes us import a module by name).

    Raises:
        DDUFLoadError: unknown library or class, or a library (or one of its backends) that is not installed.
    """
    if not isinstance(library, str) or not isinstance(class_name, str):
        raise DDUFLoadError(f"component {component!r}: model_index.json entry [{library!r}, {class_name!r}] is not [library, class]")
    module = _library(component, library)
    if library == "transformers":
        try:
            from diffusers.utils import _maybe_remap_transformers_class

            class_name = _maybe_remap_transformers_class(class_name) or class_name
        except ImportError:  # pragma: no cover - older diffusers
            pass
    try:
        cls = getattr(module, class_name, None)
    except (ImportError, RuntimeError) as e:  # lazy modules import the class's backends on access
        raise DDUFLoadError(f"component {component!r}: {library}.{class_name} cannot be imported: {e}") from e
    if cls is None or not isinstance(cls, type):
        raise DDUFLoadError(f"component {component!r}: D017: {library} has no class {class_name!r}"
                            f"{did_you_mean(class_name, module)} (model_index.json names [{library!r}, "
                            f"{class_name!r}]); upgrade {library} or pass the component yourself: "
                            f"load_dduf(..., {component}=...)", code="D017")
    if type(cls).__name__ == "DummyObject":  # diffusers/transformers placeholder for a missing backend
        backends = [b for b in getattr(cls, "_backends", []) if isinstance(b, str)]
        raise DDUFLoadError(f"component {component!r}: {class_name} needs {', '.join(backends) or 'a missing library'}; "
                            f"pip install {' '.join(backends)}".rstrip())
    return cls


def did_you_mean(name: str, module: Any) -> str:
    """`` (did you mean X?)`` with the closest class name ``module`` exports (``dir`` of a lazy module lists
    its names without importing them), or nothing."""
    import difflib

    try:
        names = sorted(n for n in dir(module) if n[:1].isupper())
    except Exception:  # noqa: BLE001 - a module's own __dir__ failing: no hint then
        return ""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.8)
    return f" (did you mean {close[0]}?)" if close else ""


def _library(component: str, library: str) -> Any:
    if library in KNOWN_LIBRARIES:
        try:
            return importlib.import_module(library)
        except ImportError as e:
            raise DDUFLoadError(f"component {component!r} needs {library}: pip install {_INSTALL[library]}") from e
    import diffusers.pipelines as pipelines

    if isinstance(library, str) and library.isidentifier() and hasattr(pipelines, library):
        return getattr(pipelines, library)
    if library in sys.modules:
        return sys.modules[library]
    raise DDUFLoadError(f"component {component!r}: library {library!r} is not one load_dduf builds components from "
                        f"({', '.join(KNOWN_LIBRARIES)}, diffusers pipeline modules, or a module you imported first); "
                        f"import it before load_dduf, or pass the component: load_dduf(..., {component}=...)")


def kind_of(cls: type[Any]) -> str:
    """``diffusers_model``, ``transformers_model``, ``config`` (a known weightless diffusers kind: schedulers,
    guiders, image processors), ``files`` (transformers tokenizers / processors / feature extractors),
    ``pipeline``, or ``unknown``. Only the model kinds get weights; an archive can make nothing else
    allocate parameters (diffusers ``AutoModel`` and modular pipelines/blocks are ``unknown``: refused)."""
    import diffusers

    if issubclass(cls, diffusers.ModelMixin):
        return "diffusers_model"
    if issubclass(cls, diffusers.DiffusionPipeline):
        return "pipeline"
    if issubclass(cls, diffusers.ConfigMixin):
        return "config" if _is_weightless_diffusers_kind(cls) else "unknown"
    if "transformers" in sys.modules or cls.__module__.startswith("transformers"):
        import transformers

        if issubclass(cls, transformers.PreTrainedModel):
            return "transformers_model"
        bases = tuple(b for n in ("PreTrainedTokenizerBase", "FeatureExtractionMixin", "ImageProcessingMixin",
                                  "ProcessorMixin") if isinstance(b := getattr(transformers, n, None), type))
        if bases and issubclass(cls, bases):
            return "files"
    return "unknown"


def _is_weightless_diffusers_kind(cls: type[Any]) -> bool:
    """Config-only diffusers classes that hold no weights: built with ``from_config`` from the archive.
    Checked in this order, each base looked up only when needed: ``diffusers.BaseGuidance`` is a lazy
    attribute whose first access imports every guider (40 ms), which a pipeline of schedulers never needs."""
    import diffusers

    for name in ("SchedulerMixin", "VaeImageProcessor", "BaseGuidance"):
        base = getattr(diffusers, name, None)
        if isinstance(base, type) and issubclass(cls, base):
            return True
    return False


# Schedulers and other config-only components allocate in proportion to some of their numbers
# (``[None] * solver_order``, arrays of ``num_train_timesteps``): ``solver_order: 4294967296`` asked for
# 32 GB, ``num_train_timesteps: 1e8`` (a float) 1.9 GB. Every number is checked, integers and floats alike,
# by the rule ``validate`` applies to scheduler and guider configs (D015, format/tokenizer_budget.py).


def _check_weightless_config(config: Any, where: str, class_name: str) -> None:
    why = config_number_problem(config)
    if why is not None:
        raise DDUFLoadError(f"{where}: D015: {why} ({class_name})", code="D015")


def build_component(cls: type[Any], files: ComponentFiles, request: ModelRequest) -> Any:
    """Build one component. Every failure comes out as a :class:`DDUFError` naming the component."""
    kind = kind_of(cls)
    try:
        if kind in ("diffusers_model", "transformers_model"):
            build = build_diffusers_model if kind == "diffusers_model" else build_transformers_model
            model = build(cls, files, request)
            check = getattr(files, "check_unchanged", None)  # archive files: not truncated while building
            if check is not None:
                check()
            return model
        if kind == "config":
            config_name = getattr(cls, "config_name", None)
            if not config_name:
                raise DDUFLoadError(f"{files.description}: {cls.__name__} has no config file name")
            config = files.read_json(config_name)
            _check_weightless_config(config, files.description, cls.__name__)
            return cls.from_config(config)
        if kind == "files":
            # transformers tokenizers/processors read their files by path: only these small files
            # are materialised, once per content (see files.local_dir). The archive never decides to run
            # code (``auto_map``) or to fetch anything: no remote code, local files only.
            return cls.from_pretrained(files.local_dir(), trust_remote_code=False, local_files_only=True)
        if kind == "pipeline":
            raise DDUFLoadError(f"{files.description}: nested pipelines ({cls.__name__}) are not supported")
        raise DDUFLoadError(f"component {files.name!r}: refusing to build {cls.__module__}.{cls.__name__} from "
                            f"{files.description}: it is neither a model (weights come from the archive) nor a "
                            "known weightless kind (scheduler, guider, image processor, tokenizer, feature "
                            f"extractor, processor); pass it yourself: load_dduf(..., {files.name}=...)")
    except DDUFError:
        raise
    except ImportError as e:
        raise DDUFLoadError(f"{files.description}: {cls.__name__} needs a missing library ({e}); pip install it") from e
    except Exception as e:  # a library's own error on damaged or mismatched data: say which component
        raise DDUFLoadError(f"{files.description}: cannot build {cls.__name__}: {type(e).__name__}: {e}") from e
    except BaseException as e:  # a Rust library's panic (tokenizers: pyo3's PanicException) on hostile files
        if type(e).__name__ != "PanicException":
            raise
        raise DDUFLoadError(f"{files.description}: cannot build {cls.__name__}: its library panicked on these "
                            f"files ({str(e).splitlines()[0] if str(e) else 'no message'})") from e
