"""Where the sampler's CPU goes on a real GPU: the default configuration against variants with one
part switched off or slowed, each for the same time in the same run (CPU ms per wall second).

    python benchmarks/bench_sampler_variants.py --seconds 10
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from bench_sampler import cpu_now  # noqa: E402

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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=10.0)
    a = ap.parse_args()
    import time

    for name, kw in VARIANTS.items():
        s = Sampler(SamplerConfig(interval=1 / a.rate, **kw))
        s.open()
        s.sample_once()
        c0, w0 = cpu_now(), time.perf_counter()
        s.start()
        time.sleep(a.seconds)
        s.stop()
        cpu, wall = cpu_now() - c0, time.perf_counter() - w0
        ov = s.overhead()
        groups = ", ".join(f"{g} {v / wall * 1e3:.2f}" for g, v in sorted(ov["group_cpu_seconds"].items()))
        print(f"{a.rate:.0f} Hz {name:<24} process {cpu / wall * 1e3:6.2f} ms/s  sampler thread "
              f"{ov['cpu_seconds'] / wall * 1e3:6.2f}  events {ov['event_thread_cpu_seconds'] / wall * 1e3:5.2f}  [{groups}]",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
