"""The cyclic collector is paused while components are built (a full collection there cost as much as the
whole SD-1.5-shaped load) and is as it was afterwards: enabled, or left disabled by the application; also
after a failed load, and with concurrent loads."""

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


def test_load_builds_every_component_paused_and_restores_the_collector(packed, monkeypatch, collector_enabled) -> None:
    from dduf_plus import load_dduf

    seen: dict[str, bool] = {}
    build = pipeline_module.build_component

    def spy(cls, files, request):
        seen[files.description.rsplit(":", 1)[-1]] = gc.isenabled()
        return build(cls, files, request)

    monkeypatch.setattr(pipeline_module, "build_component", spy)
    pipe = load_dduf(packed["tiny-sd"])
    assert set(seen) >= {"unet", "vae", "text_encoder", "tokenizer", "scheduler"} and not any(seen.values()), seen
    assert gc.isenabled() and pipe.unet is not None


def test_a_failed_build_restores_the_collector(packed, monkeypatch, collector_enabled) -> None:
    from dduf_plus import load_dduf

    def broken(cls, files, request):
        raise DDUFLoadError(f"{files.description}: broken on purpose")

    monkeypatch.setattr(pipeline_module, "build_component", broken)
    with pytest.raises(DDUFLoadError, match="broken on purpose"):
        load_dduf(packed["tiny-sd"])
    assert gc.isenabled()
