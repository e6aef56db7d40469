"""The run summary a monitor gives: `StepReport`, and its text form."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class VerdictShare:
    gpu: str
    kind: str
    share: float  # of the diagnosed windows of the run
    summary: str
    recommendation: str = ""


@dataclass
class StepReport:
    """What the steps of a run cost and how busy the GPU really was. Ratios 0..1, seconds, joules;
    None where there is no data (no GPU, no GPM on this GPU, no steps)."""

    steps: int = 0  # steps joined (warm-up included)
    warmup_steps: int = 0  # left out of every figure below
    pending_steps: int = 0  # marked but not joined yet (a report taken while running)
    step_seconds_total: float = 0.0
    step_seconds_median: float | None = None
    step_seconds_p90: float | None = None
    step_seconds_mean: float | None = None
    slow_steps: int = 0
    gpu_busy_ratio: float | None = None  # SM activity (GPM), time-weighted over the steps
    nvml_utilization_ratio: float | None = None  # what nvidia-smi's 'GPU-Util' said for the same time
    tensor_active_ratio: float | None = None
    dram_active_ratio: float | None = None
    gpu_coverage_ratio: float | None = None  # share of step time with GPU data
    power_watts: float | None = None
    energy_joules_per_step_median: float | None = None
    energy_joules_total: float | None = None
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    phase_ratio: dict[str, float] = field(default_factory=dict)  # phase -> share of step time
    verdicts: list[VerdictShare] = field(default_factory=list)
    gpus: list[str] = field(default_factory=list)
    simulated: str | None = None
    source: str = "none"  # 'sampler', 'agent' or 'none' (steps timed without GPU data)
    notes: list[str] = field(default_factory=list)  # why a figure is missing, what degraded
    log_path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return render(self)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f} %"


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if v < 10 else f"{v:.1f} s"


def render(r: StepReport) -> str:
    head = f"gpuscope: {r.steps} steps in {r.step_seconds_total:.1f} s"
    if r.warmup_steps:
        head += f" (first {r.warmup_steps} left out as warm-up)"
    if r.pending_steps:
        head += f", {r.pending_steps} not joined yet"
    if r.simulated:
        head += f"  [SIMULATED node '{r.simulated}']"
    lines = [head]
    if r.step_seconds_median is not None:
        lines.append(f"  step time      median {_ms(r.step_seconds_median)}, p90 {_ms(r.step_seconds_p90)}"
                     + (f", {r.slow_steps} slow steps" if r.slow_steps else ""))
    if r.gpu_busy_ratio is not None or r.nvml_utilization_ratio is not None:
        lines.append(f"  GPU busy       {_pct(r.gpu_busy_ratio)} of step time (SM activity)"
                     f" - NVML 'utilization' said {_pct(r.nvml_utilization_ratio)}")
    if r.tensor_active_ratio is not None or r.dram_active_ratio is not None:
        lines.append(f"  pipes          tensor {_pct(r.tensor_active_ratio)}, DRAM {_pct(r.dram_active_ratio)}")
    if r.energy_joules_per_step_median is not None:
        lines.append(f"  energy         {r.energy_joules_per_step_median:.3g} J per step (median), "
                     f"{(r.energy_joules_total or 0) / 1000:.3g} kJ in all, {r.power_watts or 0:.0f} W")
    tp = [f"{v:,.0f} {u}/s" for v, u in ((r.samples_per_second, "samples"), (r.tokens_per_second, "tokens"))
          if v is not None]
    if tp:
        lines.append("  throughput     " + ", ".join(tp))
    if r.phase_ratio:
        lines.append("  phases         " + ", ".join(f"{k} {_pct(v)}" for k, v in
                                                   sorted(r.phase_ratio.items(), key=lambda kv: -kv[1])))
    for v in r.verdicts:
        lines.append(f"  verdict        GPU {v.gpu}: {v.kind} ({_pct(v.share)} of the run) - {v.summary}")
        if v.recommendation:
            lines.append(f"                 -> {v.recommendation}")
    if r.gpus:
        lines.append(f"  GPUs           {', '.join(r.gpus)}; GPU data for {_pct(r.gpu_coverage_ratio)} of step time"
                     + (" (from the local agent)" if r.source == "agent" else ""))
    lines.extend(f"  note           {n}" for n in r.notes)
    if r.log_path:
        lines.append(f"  step log       {r.log_path}")
    return "\n".join(lines)
