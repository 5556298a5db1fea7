"""Ranks sharing a GPU each need a hardware work queue: ep_a2a asks the driver for 32 where the
process has not chosen a number, before its first cuInit (a real fresh interpreter each time;
whether cuInit then finds a GPU does not matter here)."""
import os
import subprocess
import sys

import pytest

from ep_a2a.driver import device as D

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROBE = ("import os\nfrom ep_a2a.driver import device as D\n"
          "try:\n    D.init()\nexcept D.NoDriverError:\n    pass\n"
          "print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'), D.hardware_queues())")


def _after_init(env_value):
    env = {k: v for k, v in os.environ.items() if k != D.CONNECTIONS_VAR}
    if env_value is not None:
        env[D.CONNECTIONS_VAR] = env_value
    env["PYTHONPATH"] = ROOT
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_init_asks_for_32_queues_where_the_process_chose_none():
    assert _after_init(None) == ["32", "32"]


@pytest.mark.parametrize("chosen", ["1", "12"])
def test_init_keeps_the_number_a_process_chose(chosen):
    assert _after_init(chosen) == [chosen, chosen]


@pytest.mark.parametrize("value, queues", [(None, 8), ("", 8), ("many", 8), ("16", 16)])
def test_hardware_queues_reads_the_variable_as_the_driver_does(monkeypatch, value, queues):
    monkeypatch.delenv(D.CONNECTIONS_VAR, raising=False)
    if value is not None:
        monkeypatch.setenv(D.CONNECTIONS_VAR, value)
    assert D.hardware_queues() == queues
