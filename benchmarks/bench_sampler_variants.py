"""Where the sampler's CPU goes on a real GPU: the default configuration against variants with one
part switched off, slowed or done the old way, each for the same time in the same run (CPU ms per wall
second, and per sample).

    python benchmarks/bench_sampler_variants.py --seconds 10
    python benchmarks/bench_sampler_variants.py --seconds 6 --only choices   # the issue-19 cadence choices

'choices' measures each choice behind the cost of reading nvitop's fields (bench_sampler.py): the ECC
counters batched with the memory temperature into one nvmlDeviceGetFieldValues call against the two
nvmlDeviceGetTotalEccErrors calls they replaced, and the fast fields (memory; throttle reasons and SM
clock) at 5 Hz instead of every tick, and energy and GPM at slower periods.
"""
import argparse
import os
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from bench_sampler import NVITOP_FIELDS, cpu_now  # noqa: E402

from gpuscope import Sampler, SamplerConfig  # noqa: E402

VARIANTS = {
    "default": {},
    "no events thread": {"events": False},
    "no GPM": {"gpm": False},
    "GPM window 1 s": {"gpm_window": 1.0},
    "no processes, no host": {"collect_processes": False, "collect_host": False},
    "fast group only": {"gpm": False, "events": False, "collect_processes": False, "collect_host": False,
                        "medium": 1e9, "slow": 1e9, "energy": 1e9, "rare": 1e9},
}


def ecc_by_calls(src):
    """The slow group as before issue 19: the ECC counters by two calls, the memory temperature alone."""
    lib = src.lib
    src._slow_fields = src._slow_fields[:1]
    slow = src._slow

    def _slow(self, dev):
        slow(dev)
        for metric, kind in (("gpu_ecc_corrected_errors_total", lib.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                             ("gpu_ecc_uncorrected_errors_total", lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
            self._put(dev, metric, self.nvml.call("nvmlDeviceGetTotalEccErrors", dev.handle, kind, lib.NVML_VOLATILE_ECC))

    src._slow = types.MethodType(_slow, src)


def every_other_tick(what):
    """Read part of the fast group on every second tick only (5 Hz at 10 Hz)."""

    def patch(src):
        fast, memory = src._fast, src._memory
        n = [0]

        def _fast(self, dev, now):
            n[0] += 1
            if what == "memory":
                if n[0] % 2:
                    dev.state["memory_at"] = now  # tells _fast that memory was read this tick
                fast(dev, now)
            elif n[0] % 2:
                fast(dev, now)
            elif dev.state.get("memory_at") != now:
                memory(dev)

        src._fast = types.MethodType(_fast, src)

    return patch


CHOICES = {
    "nvitop's fields": (NVITOP_FIELDS, None),
    "nvitop's fields, ECC by two calls (before)": (NVITOP_FIELDS, ecc_by_calls),
    "nvitop's fields, memory at 5 Hz": (NVITOP_FIELDS, every_other_tick("memory")),
    "nvitop's fields, reasons and SM clock at 5 Hz": (NVITOP_FIELDS, every_other_tick("reasons")),
    "default": ({}, None),
    "default, energy every 30 s": ({"energy": 30.0}, None),
    "default, GPM window 1 s": ({"gpm_window": 1.0}, None),
}


def run(name, kw, patch, rate, seconds, simulate=None):
    s = Sampler(SamplerConfig(interval=1 / rate, **kw), simulate=simulate)
    s.measure_groups = True  # every variant pays the same two CPU-clock reads per group for its breakdown
    s.open()
    if patch is not None:
        patch(s._nvml_source)
    s.sample_once()
    c0, w0, t0 = cpu_now(), time.perf_counter(), s.ticks
    s.start()
    time.sleep(seconds)
    s.stop()
    cpu, wall, ticks = cpu_now() - c0, time.perf_counter() - w0, s.ticks - t0
    ov = s.overhead()
    groups = ", ".join(f"{g} {v / wall * 1e3:.2f}" for g, v in sorted(ov["group_cpu_seconds"].items()))
    print(f"{rate:.0f} Hz {name:<46} process {cpu / wall * 1e3:6.2f} ms/s {cpu / max(ticks, 1) * 1e6:7.1f} us/sample  "
          f"sampler thread {ov['cpu_seconds'] / wall * 1e3:6.2f}  events {ov['event_thread_cpu_seconds'] / wall * 1e3:5.2f}"
          f"  [{groups}]", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--only", choices=("variants", "choices"), default="variants")
    ap.add_argument("--simulate", default=None, help="a dry run on a simulated node")
    a = ap.parse_args()
    if a.only == "choices":
        for name, (kw, patch) in CHOICES.items():
            run(name, kw, patch, a.rate, a.seconds, a.simulate)
    else:
        for name, kw in VARIANTS.items():
            run(name, kw, None, a.rate, a.seconds, a.simulate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
