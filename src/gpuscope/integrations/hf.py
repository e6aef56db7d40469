"""Hugging Face Trainer: `Trainer(..., callbacks=[GpuscopeCallback("steps.jsonl")])`.

Each optimizer step (`on_step_end`) is a step, with `per_device_train_batch_size x
gradient_accumulation_steps` samples and, when the Trainer counts them, the input tokens seen. At
each log, `gpuscope/gpu_busy_ratio`, `gpuscope/nvml_utilization_ratio`, `gpuscope/step_seconds`, ...
are added to the logs (and to `state.log_history`); at the end of training the report is printed and
written to `output_dir/gpuscope_report.json`. Reporting integrations (W&B, TensorBoard) run before
callbacks passed to the Trainer; for them to see the figures too, put this callback first:
`trainer.callback_handler.callbacks.insert(0, cb)`. Nothing it does can fail the training.
"""

from __future__ import annotations

import os
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError:
    raise ImportError("gpuscope.integrations.hf needs Hugging Face transformers: pip install transformers.") from None

from ._callbacks import CallbackCore
from ._report import StepReport

__all__ = ["GpuscopeCallback"]


class GpuscopeCallback(TrainerCallback):
    """log: a step log (.jsonl or .parquet). report_path: where the JSON report goes (default
    output_dir/gpuscope_report.json). Other keyword arguments go to `gpuscope.monitor()`."""

    def __init__(self, log: str | os.PathLike[str] | None = None, *, prefix: str = "gpuscope/",
                 print_report: bool = True, report_path: str | os.PathLike[str] | None = None,
                 all_ranks: bool = False, **monitor_kwargs: Any) -> None:
        self.core = CallbackCore(log, prefix=prefix, print_report=print_report, report_path=report_path,
                                 all_ranks=all_ranks, **monitor_kwargs)
        self._tokens_seen = 0

    @property
    def monitor(self) -> Any:
        return self.core.monitor

    @property
    def report(self) -> StepReport | None:
        return self.core.report

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self.core.begin(bool(getattr(state, "is_local_process_zero", True)), int(getattr(args, "process_index", 0)))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.core.monitor is None:
            return
        try:
            samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
            seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
            tokens, self._tokens_seen = (seen - self._tokens_seen if seen > self._tokens_seen else None), seen
        except Exception:  # noqa: BLE001 - odd arguments: the step is still marked
            samples, tokens = None, None
        self.core.step(samples, tokens)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs is None or self.core.monitor is None:
            return
        try:
            metrics = self.core.metrics()
            if metrics:
                logs.update(metrics)
                hist = getattr(state, "log_history", None)
                if hist and isinstance(hist[-1], dict):
                    hist[-1].update(metrics)
        except Exception as e:  # noqa: BLE001
            self.core.fail("on_log", e)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.core.end(getattr(args, "output_dir", None))
