"""One offline rule (storage/hub_env.py) for every module that may fetch: huggingface_hub's own rule over
``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``, read as set now, and huggingface_hub's constant when neither is
set. Before, three modules decided it three ways (env only; env or constant; constant or env)."""

from __future__ import annotations

import huggingface_hub.constants as constants
import pytest

from dduf_plus.storage import hub_env


@pytest.mark.parametrize(("hf", "transformers", "constant", "offline"), [
    ("1", None, False, True),
    ("yes", None, False, True),
    ("0", None, True, False),  # set now, explicitly: it wins over what huggingface_hub read at import
    (None, "1", False, True),
    ("0", "1", False, False),  # huggingface_hub: HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE, the first set
    (None, None, True, True),  # neither set: huggingface_hub's constant (turned on in-process)
    (None, None, False, False),
])
def test_the_offline_rule(monkeypatch: pytest.MonkeyPatch, hf, transformers, constant, offline) -> None:
    for name, value in (("HF_HUB_OFFLINE", hf), ("TRANSFORMERS_OFFLINE", transformers)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constant)
    assert hub_env.is_offline() is offline
    assert hub_env.is_offline(local_files_only=True) is True


def test_every_module_that_fetches_asks_the_one_rule() -> None:
    from dduf_plus.packing import reference_source
    from dduf_plus.refs import resolve
    from dduf_plus.remote import fetch, hub

    assert resolve.is_offline is fetch.is_offline is hub.is_offline is reference_source.is_offline \
        is hub_env.is_offline
