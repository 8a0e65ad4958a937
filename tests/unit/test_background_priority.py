"""Forget and erasure run workers lower their CPU priority (MEMORY_PIPELINES_BACKGROUND_NICE)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from memory_pipelines.lib.infra.errors import ValidationError
from memory_pipelines.lib.infra.settings import DEFAULT_BACKGROUND_NICE, ENV_BACKGROUND_NICE, Settings


def test_the_setting_defaults_to_10_and_takes_0_to_19():
    assert Settings.from_env({}).background_nice == DEFAULT_BACKGROUND_NICE == 10
    assert Settings.from_env({ENV_BACKGROUND_NICE: "0"}).background_nice == 0
    assert Settings.from_env({ENV_BACKGROUND_NICE: "19"}).background_nice == 19


@pytest.mark.parametrize("raw", ["-1", "20", "ten", "1.5"])
def test_a_bad_value_is_refused_naming_the_variable(raw):
    with pytest.raises(ValidationError) as err:
        Settings.from_env({ENV_BACKGROUND_NICE: raw})
    assert err.value.field == ENV_BACKGROUND_NICE


def test_a_worker_lowers_its_priority_once():
    # In a child: the test process keeps its own priority.
    code = (
        "import os\n"
        "from memory_pipelines.lib.infra.settings import Settings, lower_priority\n"
        "start = os.nice(0)\n"
        "s = Settings.from_env({'MEMORY_PIPELINES_BACKGROUND_NICE': '7'})\n"
        "print(lower_priority(s) - start, lower_priority(s) - start)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["7", "7"]
