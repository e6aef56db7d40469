"""PyTorch Lightning: `Trainer(callbacks=[GpuscopeCallback("steps.jsonl")])`.

Each training batch is a step. On the main process (local rank 0; `all_ranks=True` for every rank,
with `{rank}` in the log path) it logs `gpuscope/gpu_busy_ratio`, `gpuscope/nvml_utilization_ratio`,
`gpuscope/step_seconds`, ... through `pl_module.log` every `log_every_n_steps`, and prints the run's
report at the end of fit. Nothing it does can fail the fit: errors are logged once.
"""

from __future__ import annotations

import os
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError:
        raise ImportError("gpuscope.integrations.lightning needs PyTorch Lightning: "
                          "pip install lightning (or pytorch-lightning).") from None

from ._callbacks import CallbackCore
from ._report import StepReport

__all__ = ["GpuscopeCallback"]


class GpuscopeCallback(pl.Callback):
    """log: a step log (.jsonl or .parquet). log_metrics: log the GPU figures through the LightningModule.
    report_path: where the JSON report goes (default: the trainer's log_dir). Other keyword arguments
    go to `gpuscope.monitor()` (interval, simulate, devices, ...)."""

    def __init__(self, log: str | os.PathLike[str] | None = None, *, log_metrics: bool = True,
                 prefix: str = "gpuscope/", print_report: bool = True,
                 report_path: str | os.PathLike[str] | None = None, all_ranks: bool = False,
                 **monitor_kwargs: Any) -> None:
        super().__init__()
        self.core = CallbackCore(log, prefix=prefix, print_report=print_report, report_path=report_path,
                                 all_ranks=all_ranks, **monitor_kwargs)
        self.log_metrics = log_metrics

    @property
    def monitor(self) -> Any:
        return self.core.monitor

    @property
    def report(self) -> StepReport | None:
        return self.core.report

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.core.begin(getattr(trainer, "local_rank", 0) == 0, getattr(trainer, "global_rank", 0))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.core.step()
        if not self.log_metrics or self.core.monitor is None:
            return
        try:
            every = max(1, int(getattr(trainer, "log_every_n_steps", 50) or 1))
            if batch_idx % every == 0:
                metrics = self.core.metrics()
                if metrics:
                    pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, logger=True,
                                       rank_zero_only=True)
        except Exception as e:  # noqa: BLE001 - a logging problem must not stop the fit
            self.core.fail("log_metrics", e)
            self.log_metrics = False

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.core.end(getattr(trainer, "log_dir", None) if self.core.report_path is None else None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.core.end()
