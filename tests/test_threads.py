"""A load in one thread changes nothing another thread can observe (docs/security.md, "Threads").

- Construction (``meta_parameters`` / ``no_init``) beside accelerate's ``init_empty_weights`` and diffusers'
  ``no_init_weights``, which patch torch for the whole process and restore what they saw: in every order of
  entering and leaving, no recursion, no patch left behind, our blocks still build on meta.
- torch's default dtype: a fp16 load builds its modules in fp16 for its own thread only; other threads'
  ``nn.Linear`` stay fp32 and the process default is never written.
- Everything at once, for a fixed number of rounds: loads equal single-threaded loads tensor for tensor.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from dduf_plus import load_dduf
from dduf_plus.torchkit.empty_init import meta_parameters, no_init

TINY_SD = Path(__file__).resolve().parent.parent / "fixtures" / "pipelines" / "tiny-sd"


def _warm() -> None:
    """One block of each kind: torch's attributes hold their (permanent) dispatchers from here on."""
    with meta_parameters():
        nn.Linear(2, 2)


def _torch_state() -> dict[str, object]:
    state: dict[str, object] = {name: getattr(nn.init, name) for name in ("normal_", "uniform_", "kaiming_uniform_")}
    state["register_parameter"] = nn.Module.register_parameter
    state["default_dtype"] = torch.get_default_dtype()
    state["process_default_dtype"] = torch._C.get_default_dtype()
    return state


def _assert_unpatched(saved: dict[str, object]) -> None:
    """Each attribute is what it was at the start, torch's own function or dduf_plus' dispatcher (diffusers'
    ``no_init_weights`` restores the functions it saw at import, which may be torch's own; the next block
    installs the dispatcher again): never another library's patch left in place."""
    from transformers import PreTrainedModel

    now = _torch_state()
    homes = {"register_parameter": "torch.nn.modules.module"}
    for name, value in now.items():
        if value is not saved[name] and value != saved[name]:
            assert getattr(value, "__module__", None) in (homes.get(name, "torch.nn.init"),
                                                          "dduf_plus.torchkit.empty_init"), (name, value)
    assert PreTrainedModel.tie_weights.__module__ == "transformers.modeling_utils"  # transformers' own patch


def _assert_torch_behaves() -> None:
    """Outside any block, in this thread: torch's own construction (real, initialised, fp32)."""
    torch.manual_seed(0)
    layer = nn.Linear(16, 16)
    bound = 1 / math.sqrt(16)
    assert not layer.weight.is_meta and layer.weight.dtype == torch.float32
    assert 0 < layer.weight.abs().max() <= bound  # kaiming-uniform ran: neither skipped nor garbage
    assert nn.init.normal_(torch.zeros(64)).abs().sum() > 0
    with meta_parameters():
        assert nn.Linear(2, 2).weight.is_meta


def _leave(context: contextlib.AbstractContextManager) -> None:
    context.__exit__(None, None, None)


ORDERS = {  # (who enters first, who leaves first)
    "ours-in-theirs-out-last": ("ours", "ours"),
    "ours-in-ours-out-last": ("ours", "theirs"),
    "theirs-in-theirs-out-last": ("theirs", "ours"),
    "theirs-in-ours-out-last": ("theirs", "theirs"),
}


def _accelerate() -> contextlib.AbstractContextManager:
    from accelerate import init_empty_weights

    return init_empty_weights()


def _diffusers() -> contextlib.AbstractContextManager:
    from diffusers.models.modeling_utils import no_init_weights

    return no_init_weights()


def _transformers() -> contextlib.AbstractContextManager:
    from transformers.initialization import guard_torch_init_functions

    return guard_torch_init_functions()


@pytest.mark.parametrize("theirs_factory", [_accelerate, _diffusers, _transformers],
                         ids=["accelerate", "diffusers", "transformers"])
@pytest.mark.parametrize("order", list(ORDERS))
def test_interleaved_with_libraries_that_patch_torch(order: str,
                                                     theirs_factory: Callable[[], contextlib.AbstractContextManager]
                                                     ) -> None:
    """A library that patches torch process-wide and restores what it saw, entered and left in every order
    around one of our blocks (another thread does exactly this): afterwards torch behaves as torch, our next
    block still builds on meta, and no call recurses. 0.6.1 recorded its own patch as torch's original here
    and every later construction raised RecursionError."""
    _warm()
    saved = _torch_state()
    first_in, first_out = ORDERS[order]
    for _ in range(2):  # the second round starts from whatever the first left
        ours, theirs = meta_parameters(), theirs_factory()
        entered = [ours, theirs] if first_in == "ours" else [theirs, ours]
        for context in entered:
            context.__enter__()
        built_inside = nn.Linear(3, 3)  # in our block, whatever else is in force
        _leave(ours if first_out == "ours" else theirs)
        if first_out == "theirs":
            assert nn.Linear(3, 3).weight.is_meta  # their restore does not end our block
        _leave(theirs if first_out == "ours" else ours)
        assert built_inside.weight.is_meta
    _assert_torch_behaves()
    _assert_unpatched(saved)


def test_other_threads_do_not_see_a_loads_default_dtype() -> None:
    from dduf_plus.torchkit.thread_dtype import local_default_dtype

    inside, release = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def loader() -> None:
        with local_default_dtype(torch.float16):
            seen["linear"] = nn.Linear(2, 2).weight.dtype
            seen["get"] = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)  # what diffusers and transformers do inside a load
            seen["after_set"] = (nn.Linear(2, 2).weight.dtype, torch.tensor([1.5]).dtype)
            inside.set()
            release.wait(10)
        seen["outside"] = torch.get_default_dtype()

    thread = threading.Thread(target=loader)
    thread.start()
    try:
        assert inside.wait(10)
        here = (nn.Linear(2, 2).weight.dtype, torch.tensor([1.5]).dtype, torch.zeros(1).dtype,
                torch.get_default_dtype(), torch._C.get_default_dtype())
    finally:
        release.set()
        thread.join(10)
    assert here == (torch.float32,) * 5
    # outside every block torch's own functions are back (torch.compile knows them by identity)
    assert torch.get_default_dtype is torch._C.get_default_dtype and torch.set_default_dtype.__module__ == "torch"
    assert seen == {"linear": torch.float16, "get": torch.float16,
                    "after_set": (torch.bfloat16, torch.bfloat16), "outside": torch.float32}


def _construction_probe() -> dict[str, torch.Tensor]:
    """Tensors made the ways model constructors make them without naming a dtype."""
    ints = torch.arange(4100)
    return {
        "empty": torch.empty(3), "zeros": torch.zeros(2, 2), "ones": torch.ones(2), "eye": torch.eye(2),
        "linspace": torch.linspace(0, 1, 7), "tensor": torch.tensor([1.1, 2.2]), "int_tensor": torch.tensor([1, 2]),
        "full": torch.full((2,), 0.1), "full_int": torch.full((2,), 3), "arange_float": torch.arange(0, 1, 0.1),
        "arange_int": ints, "divided": ints / 7, "scaled": ints * 0.001, "sqrt": torch.sqrt(torch.tensor(2)),
        "where": torch.where(ints > 2, 1.0, 0.0), "explicit": ints.float() / 3, "to": ints.to(torch.float32),
        "sin": torch.sin(torch.arange(10, dtype=torch.float32) / 10),
        "parameter": nn.Parameter(torch.empty(2)), "linear": nn.Linear(3, 3).bias, "rand": torch.rand(2),
        "normal": torch.normal(0.0, 1.0, size=(3,)), "int_div": torch.tensor(7) / 2,
    }


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_thread_default_equals_torchs_own(dtype: torch.dtype) -> None:
    """What the thread's default gives equals what ``torch.set_default_dtype`` gives, value and dtype."""
    from dduf_plus.torchkit.thread_dtype import local_default_dtype

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        theirs = _construction_probe()
    finally:
        torch.set_default_dtype(previous)
    with local_default_dtype(dtype):
        torch.manual_seed(0)
        ours = _construction_probe()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype, name
        if name not in ("empty", "parameter", "linear"):  # uninitialised memory / random init
            assert torch.equal(ours[name], tensor), name


# --- everything at once --------------------------------------------------------------------------------------
def _state(pipe: object) -> dict[str, torch.Tensor]:
    out = {}
    for component, module in pipe.components.items():  # type: ignore[attr-defined]
        if isinstance(module, nn.Module):
            for name, tensor in (*module.named_parameters(), *module.named_buffers()):
                out[f"{component}.{name}"] = tensor
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name, tensor in a.items():
        assert b[name].dtype == tensor.dtype and not b[name].is_meta and torch.equal(b[name], tensor), name


class Threads:
    """Threads that each run ``rounds`` times and keep their first failure."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.failures: list[BaseException] = []
        self.stop = threading.Event()

    def add(self, work: Callable[[], None], rounds: int | None) -> None:
        def run() -> None:
            done = 0
            try:
                while (rounds is None and not self.stop.is_set()) or (rounds is not None and done < rounds):
                    work()
                    done += 1
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.failures.append(e)

        self.threads.append(threading.Thread(target=run, daemon=True))

    def run(self, background: int) -> None:
        """Start all; the last ``background`` threads (rounds=None) run until the others are done."""
        for thread in self.threads:
            thread.start()
        for thread in self.threads[:len(self.threads) - background]:
            thread.join(120)
        self.stop.set()
        for thread in self.threads:
            thread.join(30)
        assert not any(t.is_alive() for t in self.threads)
        if self.failures:
            raise self.failures[0]


@pytest.fixture(scope="module")
def references(packed: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    _warm()
    return {str(dtype): _state(load_dduf(packed["tiny-sd"], dtype=dtype)) for dtype in (torch.float16, "auto")}


def _loader(archive: Path, dtype: object, reference: dict[str, torch.Tensor]) -> Callable[[], None]:
    return lambda: _assert_same(reference, _state(load_dduf(archive, dtype=dtype)))


def _accelerate_build() -> None:
    from accelerate import init_empty_weights

    with init_empty_weights():
        assert nn.Linear(4, 4).weight.is_meta


def _diffusers_loader() -> Callable[[], None]:
    from diffusers import AutoencoderKL

    reference = {k: v.clone() for k, v in AutoencoderKL.from_pretrained(TINY_SD / "vae").state_dict().items()}

    def load() -> None:
        state = AutoencoderKL.from_pretrained(TINY_SD / "vae").state_dict()
        assert all(torch.equal(state[k], v) for k, v in reference.items())

    return load


# One library that patches torch for the whole process at a time: accelerate's init_empty_weights in two
# threads (diffusers' from_pretrained runs it) restore each other's patch out of order and leave it in place,
# whatever else runs; that is theirs to fix.
@pytest.mark.parametrize("beside", ["accelerate", "diffusers"])
def test_loads_beside_libraries_that_patch_torch(beside: str, packed: dict[str, Path], references) -> None:  # noqa: ANN001
    """Loads in threads beside accelerate's ``init_empty_weights`` or diffusers' own ``from_pretrained``
    (which patch torch for the whole process while they run) in a loop: every load equals a
    single-threaded one, theirs work as usual, and afterwards torch is as it was (0.6.1: RecursionError in
    every later construction, within seconds)."""
    other = _accelerate_build if beside == "accelerate" else _diffusers_loader()
    saved = _torch_state()
    threads = Threads()
    for dtype in (torch.float16, "auto"):
        threads.add(_loader(packed["tiny-sd"], dtype, references[str(dtype)]), rounds=3)
    threads.add(other, rounds=None)
    threads.run(background=1)
    _assert_torch_behaves()
    _assert_unpatched(saved)


def test_loads_beside_threads_that_build_models(packed: dict[str, Path], references) -> None:  # noqa: ANN001
    """fp16 loads in threads beside threads building ``nn.Linear``: those come out fp32, real and initialised
    (0.6.1: 2,371 of 6,567 came out fp16), the loads equal single-threaded ones, and torch's default dtype is
    fp32 throughout and afterwards (0.6.1 could leave it fp16)."""
    saved = _torch_state()
    counts = {"built": 0}

    def build() -> None:
        layer = nn.Linear(8, 8)
        assert (layer.weight.dtype, layer.weight.device.type) == (torch.float32, "cpu")
        assert 0 < layer.weight.abs().max() <= 1 / math.sqrt(8)  # initialised (not skipped, not garbage)
        assert torch.tensor([0.5]).dtype == torch.float32 and torch.get_default_dtype() == torch.float32
        counts["built"] += 1

    threads = Threads()
    threads.add(_loader(packed["tiny-sd"], torch.float16, references[str(torch.float16)]), rounds=3)
    threads.add(_loader(packed["tiny-sd"], torch.float16, references[str(torch.float16)]), rounds=3)
    threads.add(_loader(packed["tiny-sd"], "auto", references["auto"]), rounds=2)
    threads.add(build, rounds=None)
    threads.add(build, rounds=None)
    threads.run(background=2)
    assert counts["built"] > 100
    _assert_torch_behaves()
    _assert_unpatched(saved)


def test_no_init_alone_is_thread_local_too() -> None:
    inside, release = threading.Event(), threading.Event()

    def builder() -> None:
        with no_init():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=builder)
    thread.start()
    try:
        assert inside.wait(10)
        assert nn.init.normal_(torch.zeros(32)).abs().sum() > 0
    finally:
        release.set()
        thread.join(10)
