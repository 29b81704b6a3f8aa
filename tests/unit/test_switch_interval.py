"""``polling.switch_interval_ms`` reaches the engine process's Python (``startup.apply_switch_interval``), and
unset leaves the process's interval alone."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from kvpush.config import Config
from kvpush.integrations.vllm.startup import apply_switch_interval


@pytest.fixture
def restore_interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_the_setting_becomes_the_processs_switch_interval(restore_interval: float) -> None:
    assert apply_switch_interval(Config.from_dict({"switch_interval_ms": 0.5})) == pytest.approx(0.5e-3)
    assert sys.getswitchinterval() == pytest.approx(0.5e-3)
    assert apply_switch_interval(Config.from_dict({"polling": {"switch_interval_ms": 2}})) == pytest.approx(2e-3)


def test_unset_leaves_the_process_alone(restore_interval: float) -> None:
    sys.setswitchinterval(0.007)
    assert apply_switch_interval(Config()) is None
    assert sys.getswitchinterval() == pytest.approx(0.007)
