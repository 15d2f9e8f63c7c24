"""The cyclic collector is paused while a load imports (a first load's imports tripped about 1 s of full
collections) and is as it was afterwards: enabled, or left disabled by the application; also after a failed
load, and with concurrent loads."""

from __future__ import annotations

import gc
import threading

import pytest

from dduf_plus.errors import DDUFLoadError
from dduf_plus.loading import pipeline as pipeline_module
from dduf_plus.loading.gc_pause import collector_paused


@pytest.fixture
def collector_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_no_collection_runs_inside_the_pause_and_the_collector_comes_back(collector_enabled) -> None:
    collections: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    try:
        with collector_paused():
            gc.callbacks.append(record)  # from here: entering may itself have tripped a collection just before
            assert not gc.isenabled()
            with collector_paused():  # nested: still paused when the inner block ends
                pass
            assert not gc.isenabled()
            junk = [[i] for i in range(200_000)]  # far past every generation's threshold
            del junk
            assert collections == []
    finally:
        if record in gc.callbacks:
            gc.callbacks.remove(record)
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled() -> None:
    was = gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()


def test_concurrent_pauses_end_with_the_last(collector_enabled) -> None:
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with collector_paused():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(10)
    with collector_paused():
        pass
    assert not gc.isenabled()  # the other thread's load is still building
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_a_load_pauses_its_imports_not_its_construction(packed, monkeypatch, collector_enabled) -> None:
    """Class resolution (imports) runs paused; building models does not (a pause there would only move a
    collection owed by earlier imports to after the load)."""
    from dduf_plus import load_dduf

    resolving: dict[str, bool] = {}
    building: dict[str, bool] = {}
    resolve, build = pipeline_module.resolve_class, pipeline_module.build_component

    def resolve_spy(name, library, class_name):
        resolving[name] = gc.isenabled()
        return resolve(name, library, class_name)

    def build_spy(cls, files, request):
        building[files.description.rsplit(":", 1)[-1]] = gc.isenabled()
        return build(cls, files, request)

    monkeypatch.setattr(pipeline_module, "resolve_class", resolve_spy)
    monkeypatch.setattr(pipeline_module, "build_component", build_spy)
    pipe = load_dduf(packed["tiny-sd"])
    assert set(resolving) >= {"unet", "vae", "text_encoder", "tokenizer", "scheduler"}, resolving
    assert not any(resolving.values()) and all(building.values()), (resolving, building)
    assert gc.isenabled() and pipe.unet is not None


def test_a_failed_plan_restores_the_collector(packed, monkeypatch, collector_enabled) -> None:
    from dduf_plus import load_dduf

    def broken(name, library, class_name):
        raise DDUFLoadError(f"{name}: broken on purpose")

    monkeypatch.setattr(pipeline_module, "resolve_class", broken)
    with pytest.raises(DDUFLoadError, match="broken on purpose"):
        load_dduf(packed["tiny-sd"])
    assert gc.isenabled()
