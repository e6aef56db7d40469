"""A host-process reader for tests, importable by name from any test module (a test that imports from
`conftest` gets tests/gpu/conftest.py instead when pytest-xdist collects both)."""

from __future__ import annotations

from gpuscope._hostproc import HostProcInfo


class FakeHostReader:
    """The HostReader protocol: pids in `infos` are visible on the host, every other pid is not."""

    def __init__(self, infos: dict[int, HostProcInfo] | None = None) -> None:
        self.infos = dict(infos or {})
        self.reads: list[int] = []
        self.forgotten: list[set[int]] = []

    def read(self, pid: int) -> HostProcInfo | None:
        self.reads.append(pid)
        return self.infos.get(pid)

    def forget(self, alive: set[int]) -> None:
        self.forgotten.append(set(alive))
