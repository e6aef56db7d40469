"""Fixtures shared by the GPU tests (`pytest -m gpu`)."""

from __future__ import annotations

import pytest

from gpuscope import Sampler, SamplerConfig


@pytest.fixture(scope="module")
def sampler():
    """This machine's GPUs sampled every 0.1 s for the module's tests; skipped without a usable GPU."""
    s = Sampler(SamplerConfig(interval=0.1))
    try:
        s.open()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no usable NVIDIA GPU: {e}")
    if not s.devices:
        pytest.skip("NVML lists no GPU")
    s.start()
    yield s
    s.stop()
