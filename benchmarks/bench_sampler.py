"""Sampler cost: CPU per wall second and per sample at 10 Hz and 100 Hz, against nvitop reading the
same NVML fields at the same rate in the same run, plus the per-call NVML latency table from the
sampler's own accounting and a probe of the costly calls.

    python benchmarks/bench_sampler.py --seconds 20            # on a GPU machine
    python benchmarks/bench_sampler.py --seconds 3 --simulate healthy   # dry run anywhere (no nvitop)

gpuscope reads all default fields: NVML fast fields every tick, GPM every 200 ms, processes (with
host CPU / RSS / command line) and host every second, energy every 5 s, events in their thread.
nvitop reads what it can of the same (it has no GPM, throttle reasons or energy counter): per tick
utilization, memory, power, temperature, clocks, performance state; every second the process list
with per-process utilization, CPU %, RSS, command and user. Its fair best: `Device.oneshot()`.

"gpuscope, nvitop's fields" is the comparison for the same fields (issue 19): the sampler with GPM, host
metrics and the event thread off, so it reads what nvitop reads (plus throttle reasons, the energy counter,
ECC and PCIe link state), each at the rate its meaning needs instead of every tick.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from gpuscope import Sampler, SamplerConfig  # noqa: E402


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


NVITOP_FIELDS = {"gpm": False, "collect_host": False, "events": False}


def bench_gpuscope(rate: float, seconds: float, simulate: str | None, flat: bool = False, groups: bool = False,
                   **kw: object) -> dict:
    cfg = SamplerConfig(interval=1.0 / rate, **kw)
    if flat:  # every field nvitop reads, read every tick as nvitop does (no cost-aware cadence)
        cfg.medium = cfg.interval
    s = Sampler(cfg, simulate=simulate)
    s.measure_groups = groups  # the breakdown costs two CPU-clock reads per group and tick: off as in use
    s.open()
    s.sample_once()  # warm: discovery, first GPM sample, process objects
    s.group_cpu_seconds.clear()  # attribute only the measured run
    s.cpu_seconds = 0.0
    c0, w0, t0 = cpu_now(), time.perf_counter(), s.ticks
    s.start()
    time.sleep(seconds)
    s.stop()
    cpu, wall, ticks = cpu_now() - c0, time.perf_counter() - w0, s.ticks - t0
    ov = s.overhead()
    tool = "gpuscope-flat" if flat else "gpuscope, nvitop's fields" if kw == NVITOP_FIELDS else "gpuscope"
    return {"tool": tool, "rate_hz": rate, "wall_s": wall, "cpu_s": cpu, "ticks": ticks,
            "cpu_per_wall": cpu / wall, "cpu_per_sample_us": cpu / max(ticks, 1) * 1e6,
            "sampler_thread_cpu_s": ov["cpu_seconds"], "missed_ticks": ov["missed_ticks"],
            "group_cpu_s": ov["group_cpu_seconds"], "event_thread_cpu_s": ov["event_thread_cpu_seconds"],
            "tick_median_us": ov["tick_median_us"], "nvml_calls": ov["nvml_calls"],
            "gpus": len(s.devices)}


def bench_nvitop(rate: float, seconds: float) -> dict:
    from nvitop import Device

    devices = Device.all()
    interval = 1.0 / rate
    stop = threading.Event()
    ticks = [0]

    def loop() -> None:
        t0 = time.monotonic()
        k, next_proc = 0, 0.0
        while not stop.is_set():
            due = t0 + k * interval
            now = time.monotonic()
            if now < due:
                time.sleep(due - now)
            for d in devices:
                with d.oneshot():
                    d.gpu_utilization(), d.memory_utilization(), d.memory_used(), d.memory_free()
                    d.power_usage(), d.temperature(), d.sm_clock(), d.memory_clock(), d.graphics_clock()
                    d.performance_state()
                if now >= next_proc:
                    d.encoder_utilization(), d.decoder_utilization()
                    for p in d.processes().values():
                        with p.oneshot():
                            p.gpu_memory(), p.gpu_sm_utilization(), p.cpu_percent(), p.host_memory()
                            p.command(), p.username()
            if now >= next_proc:
                next_proc = now + 1.0
            ticks[0] += 1
            k += 1

    c0, w0 = cpu_now(), time.perf_counter()
    th = threading.Thread(target=loop)
    th.start()
    time.sleep(seconds)
    stop.set()
    th.join()
    cpu, wall = cpu_now() - c0, time.perf_counter() - w0
    return {"tool": "nvitop", "rate_hz": rate, "wall_s": wall, "cpu_s": cpu, "ticks": ticks[0],
            "cpu_per_wall": cpu / wall, "cpu_per_sample_us": cpu / max(ticks[0], 1) * 1e6}


def probe_costly_calls(n: int = 50) -> list[dict]:
    """Median cost of the calls the cadence plan is built around, measured here and now."""
    import pynvml as N

    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    probes = {
        "nvmlDeviceGetTotalEnergyConsumption": lambda: N.nvmlDeviceGetTotalEnergyConsumption(h),
        "nvmlDeviceGetFieldValues(TOTAL_ENERGY)": lambda: N.nvmlDeviceGetFieldValues(h, [N.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION]),
        "nvmlDeviceGetFieldValues(PCIE_COUNT_TX/RX)": lambda: N.nvmlDeviceGetFieldValues(
            h, [N.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, N.NVML_FI_DEV_PCIE_COUNT_RX_BYTES]),
        "nvmlDeviceGetPowerUsage": lambda: N.nvmlDeviceGetPowerUsage(h),
        "nvmlDeviceGetUtilizationRates": lambda: N.nvmlDeviceGetUtilizationRates(h),
    }
    out = []
    for name, fn in probes.items():
        ts = []
        err = ""
        for _ in range(n):
            t = time.perf_counter_ns()
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                err = str(e)
            ts.append(time.perf_counter_ns() - t)
        ts.sort()
        out.append({"call": name, "median_us": ts[len(ts) // 2] / 1e3, "max_us": ts[-1] / 1e3, "error": err})
    N.nvmlShutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rates", default="10,100")
    ap.add_argument("--simulate", default=None, help="dry run on a simulated node (nvitop is skipped)")
    ap.add_argument("--json", default=None, help="write all results here")
    ap.add_argument("--no-flat", action="store_true", help="leave out the every-tick ('flat') variant")
    ap.add_argument("--groups", action="store_true", help="measure each cadence group's CPU too (its own cost in the figures)")
    a = ap.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    results: dict = {"date": time.strftime("%Y-%m-%d"), "host": os.uname().nodename, "runs": []}
    if a.simulate is None:
        results["probe"] = probe_costly_calls()
        for p in results["probe"]:
            print(f"probe {p['call']:<44} median {p['median_us']:8.1f} us  max {p['max_us']:8.1f} us {p['error']}")
    for rate in rates:
        g = bench_gpuscope(rate, a.seconds, a.simulate, groups=a.groups)
        results["runs"].append(g)
        line = (f"{rate:>5.0f} Hz  gpuscope: {g['cpu_per_wall'] * 100:6.3f} % of a core, "
                f"{g['cpu_per_sample_us']:8.1f} us CPU/sample, {g['ticks']} samples, missed {g['missed_ticks']}")
        if a.simulate is None:
            n = bench_nvitop(rate, a.seconds)
            results["runs"].append(n)
            ratio = g["cpu_per_sample_us"] / n["cpu_per_sample_us"]
            line += (f" | nvitop: {n['cpu_per_wall'] * 100:6.3f} % of a core, {n['cpu_per_sample_us']:8.1f} us "
                     f"CPU/sample, {n['ticks']} samples | ratio gpuscope/nvitop per sample {ratio:.2f}")
            g["ratio_vs_nvitop"] = ratio
            same = bench_gpuscope(rate, a.seconds, a.simulate, groups=a.groups, **NVITOP_FIELDS)
            same["ratio_vs_nvitop"] = same["cpu_per_sample_us"] / n["cpu_per_sample_us"]
            results["runs"].append(same)
            line += (f"\n        gpuscope reading nvitop's fields (no GPM, host, events): {same['cpu_per_wall'] * 100:6.3f} % "
                     f"of a core, {same['cpu_per_sample_us']:8.1f} us CPU/sample, ratio {same['ratio_vs_nvitop']:.2f}")
            if a.no_flat:
                print(line, flush=True)
                continue
            f = bench_gpuscope(rate, a.seconds, a.simulate, flat=True, groups=a.groups)
            f["ratio_vs_nvitop"] = f["cpu_per_sample_us"] / n["cpu_per_sample_us"]
            results["runs"].append(f)
            line += (f"\n        gpuscope with utilization and power read every tick too: {f['cpu_per_wall'] * 100:6.3f} % "
                     f"of a core, {f['cpu_per_sample_us']:8.1f} us CPU/sample, ratio {f['ratio_vs_nvitop']:.2f}")
        print(line, flush=True)
    for r in results["runs"]:
        if "group_cpu_s" in r:
            parts = ", ".join(f"{g} {v / r['wall_s'] * 1e3:.2f}" for g, v in sorted(r["group_cpu_s"].items()))
            print(f"{r['tool']} {r['rate_hz']:.0f} Hz CPU ms per wall second: sampler thread "
                  f"{r['sampler_thread_cpu_s'] / r['wall_s'] * 1e3:.2f} ({parts}); event thread "
                  f"{r['event_thread_cpu_s'] / r['wall_s'] * 1e3:.2f}; whole process {r['cpu_s'] / r['wall_s'] * 1e3:.2f}")
    last = results["runs"][0]
    print("\nper-call NVML latency from the sampler's own accounting (10 Hz run), median / max us:")
    for c in last["nvml_calls"]:
        print(f"  {c['call']:<42} {c['median_us']:9.1f} {c['max_us']:9.1f}  x{c['count']}  errors {c['errors']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
