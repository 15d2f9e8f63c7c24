"""The cyclic collector is paused while a load imports (a first load's imports tripped about 1 s of full
collections) and is as it was afterwards: enabled, or left disabled by the application; also after a failed
load. With other threads alive nothing is paused (they would see it)."""

from __future__ import annotations

import gc
import threading

import pytest

from dduf_plus.errors import DDUFLoadError
from dduf_plus.loading import gc_pause
from dduf_plus.loading import pipeline as pipeline_module
from dduf_plus.loading.gc_pause import collector_paused


@pytest.fixture
def collector_enabled(monkeypatch):
    # as in a process with one thread: earlier tests may leave daemon threads (servers, read-ahead) running
    monkeypatch.setattr(gc_pause, "other_threads_alive", lambda: False)
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


def test_a_disabled_collector_stays_disabled(monkeypatch) -> None:
    monkeypatch.setattr(gc_pause, "other_threads_alive", lambda: False)
    was = gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()


def test_no_pause_while_other_threads_run(collector_enabled, monkeypatch) -> None:
    """With another thread alive a load leaves the collector alone: that thread would see it disabled, and
    its own ``gc.disable()`` would be undone when the pause ended (0.6.1 did both)."""
    monkeypatch.setattr(gc_pause, "other_threads_alive", lambda: threading.active_count() > 1)  # the real rule
    inside, release = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def other() -> None:
        inside.set()
        release.wait(10)
        seen["other"] = gc.isenabled()

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert inside.wait(10)
        with collector_paused():
            assert gc.isenabled()
            gc.disable()  # the application's own choice, made meanwhile
            release.set()
            thread.join(10)
        assert not gc.isenabled()  # not undone by the end of the load
    finally:
        release.set()
        thread.join(10)
        gc.enable()
    assert seen == {"other": False}  # what the application set, nothing else


def _spy_on_pauses(monkeypatch) -> tuple[dict[str, bool], dict[str, bool]]:
    """({component: collector enabled while its class was resolved}, {component: ... while it was built})."""
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
    return resolving, building


def test_a_local_load_pauses_its_imports_and_its_construction(packed, monkeypatch, collector_enabled) -> None:
    from dduf_plus import load_dduf

    resolving, building = _spy_on_pauses(monkeypatch)
    pipe = load_dduf(packed["tiny-sd"])
    assert set(resolving) >= {"unet", "vae", "text_encoder", "tokenizer", "scheduler"}, resolving
    assert set(building) == set(resolving), building
    assert not any(resolving.values()) and not any(building.values()), (resolving, building)
    assert gc.isenabled() and pipe.unet is not None


def test_a_remote_load_builds_with_the_collector_running(packed, tmp_path, monkeypatch, collector_enabled) -> None:
    """A remote build waits for bytes between components: no pause spans a network wait."""
    import shutil
    import sys
    from pathlib import Path

    from dduf_plus import load_dduf

    sys.path.insert(0, str(Path(__file__).parent))
    from servers import FileServer

    monkeypatch.setenv("DDUF_PLUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    (tmp_path / "www").mkdir()
    shutil.copyfile(packed["tiny-sd"], tmp_path / "www" / "tiny-sd.dduf")
    resolving, building = _spy_on_pauses(monkeypatch)
    with FileServer(tmp_path / "www") as server:
        pipe = load_dduf(server.url("tiny-sd.dduf"))
    assert building and all(building.values()), building
    assert not any(resolving.values()), resolving
    assert gc.isenabled() and pipe.unet is not None


def test_a_failed_plan_restores_the_collector(packed, monkeypatch, collector_enabled) -> None:
    from dduf_plus import load_dduf

    def broken(name, library, class_name):
        raise DDUFLoadError(f"{name}: broken on purpose")

    monkeypatch.setattr(pipeline_module, "resolve_class", broken)
    with pytest.raises(DDUFLoadError, match="broken on purpose"):
        load_dduf(packed["tiny-sd"])
    assert gc.isenabled()
