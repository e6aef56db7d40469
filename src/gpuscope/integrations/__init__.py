"""Training-loop integrations: `monitor()` for any loop; `gpuscope.integrations.lightning` and
`gpuscope.integrations.hf` hold callbacks for PyTorch Lightning and the Hugging Face Trainer (imported
only when asked for, so `import gpuscope` never imports torch, lightning or transformers)."""

from ._report import StepReport, VerdictShare
from .monitor import Monitor, MonitorError, monitor

__all__ = ["Monitor", "MonitorError", "StepReport", "VerdictShare", "monitor"]
