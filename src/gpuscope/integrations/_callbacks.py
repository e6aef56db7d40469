"""What the Lightning and Hugging Face callbacks share, free of either framework (so it is tested
without them): start a monitor on the main process, mark steps, hand out metrics, write the report."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ._report import StepReport
from ._steplog import LogError, check_log_path
from .monitor import Monitor, MonitorError

log = logging.getLogger("gpuscope.monitor")


class CallbackCore:
    def __init__(self, log: str | os.PathLike[str] | None = None, *, prefix: str = "gpuscope/",
                 print_report: bool = True, report_path: str | os.PathLike[str] | None = None,
                 all_ranks: bool = False, **monitor_kwargs: Any) -> None:
        self.log_path = None if log is None else str(log)
        if self.log_path is not None:
            try:
                check_log_path(self.log_path.replace("{rank}", "0"))
            except LogError as e:
                raise MonitorError(str(e)) from None
        Monitor(**monitor_kwargs)  # argument errors now, not mid-run (opens nothing until start)
        self.prefix = prefix
        self.print_report = print_report
        self.report_path = None if report_path is None else str(report_path)
        self.all_ranks = all_ranks
        self.monitor_kwargs = monitor_kwargs
        self.monitor: Monitor | None = None
        self.report: StepReport | None = None
        self._failed: set[str] = set()

    def begin(self, main_process: bool, rank: int = 0) -> None:
        if self.monitor is not None or not (main_process or self.all_ranks):
            return
        try:
            path = self.log_path.replace("{rank}", str(rank)) if self.log_path else None
            self.monitor = Monitor(log=path, print_report=self.print_report, **self.monitor_kwargs).start()
        except Exception as e:  # noqa: BLE001 - training goes on unmonitored
            self.fail("start", e)

    def step(self, samples: float | None = None, tokens: float | None = None) -> None:
        m = self.monitor
        if m is not None:
            m.step(samples, tokens)

    def metrics(self) -> dict[str, float]:
        m = self.monitor
        if m is None:
            return {}
        return {self.prefix + k: float(v) for k, v in m.metrics().items()}

    def end(self, default_dir: str | os.PathLike[str] | None = None) -> StepReport | None:
        m, self.monitor = self.monitor, None
        if m is None:
            return self.report
        self.report = m.stop()
        try:
            path = self.report_path or (os.path.join(default_dir, "gpuscope_report.json") if default_dir else None)
            if path:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).write_text(json.dumps(self.report.to_dict(), indent=1, default=str) + "\n")
        except Exception as e:  # noqa: BLE001 - an odd output_dir loses the report file, not the run
            self.fail("report", e)
        return self.report

    def fail(self, where: str, e: BaseException) -> None:
        if where not in self._failed:
            self._failed.add(where)
            log.warning("gpuscope callback: %s failed: %s: %s (logged once)", where, type(e).__name__, e)
