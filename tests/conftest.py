"""Shared doubles for the telemetry-core tests: a settable clock, a host-process reader that knows only
the pids it is given, and a sampler factory that always stops what it started; and the real headless
Chromium the page, report and SVG tests drive."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from host_fakes import FakeHostReader  # noqa: F401 - the fixtures below build it; tests import host_fakes

from gpuscope import Sampler, SamplerConfig
from gpuscope._nvml import Nvml
from gpuscope.sources.device import Device, discover


class FakeClock:
    """A monotonic clock a test moves by hand (seconds)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t


def pytest_configure(config: pytest.Config) -> None:
    # A pytest-xdist worker runs with COLUMNS=80 and LINES=24 in its environment; a child that sizes itself
    # to its terminal (shutil.get_terminal_size: `gpuscope top` in tmux) would believe them over the terminal.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.pop("COLUMNS", None)
        os.environ.pop("LINES", None)


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def host_reader() -> FakeHostReader:
    return FakeHostReader()


@pytest.fixture
def make_sampler() -> Iterator[Callable[..., Sampler]]:
    """make_sampler(fake_nvml, host_reader=..., **config) -> Sampler, stopped at teardown.

    Defaults keep tests fast and hermetic: 10 ms interval, no host source (psutil), no event thread
    (its 500 ms wait makes stop() slow); a test that needs one turns it on."""
    made: list[Sampler] = []

    def make(fake: Any, *, host_reader: Any = None, host_source: Any = None, **config: Any) -> Sampler:
        cfg = {"interval": 0.01, "collect_host": False, "events": False}
        cfg.update(config)
        s = Sampler(SamplerConfig(**cfg), nvml=fake, host_reader=host_reader or FakeHostReader(),
                    host_source=host_source)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


@pytest.fixture
def open_devices() -> Callable[[Any], tuple[Nvml, list[Device]]]:
    """open_devices(fake_nvml) -> (initialised Nvml wrapper, discovered devices), for source-level tests."""

    def open_(fake: Any) -> tuple[Nvml, list[Device]]:
        nv = Nvml(fake)
        nv.init()
        return nv, discover(nv)

    return open_


@pytest.fixture(scope="session")
def chromium() -> str:
    """The Debian Chromium's path. Missing: a failure in CI (.ci/run installs it), a skip elsewhere."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; .ci/run installs it")
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    return exe
