"""`gpuscope sample`: print snapshots: per GPU the true SM activity beside NVML utilization."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections import deque
from dataclasses import asdict
from typing import Any

from .._args import add_source_args, check_sim, interval
from ..errors import EXIT_OK, UsageError
from ..sampler import Sampler, SamplerConfig

HELP = 'print snapshots: per GPU the true SM activity beside NVML utilization'
DESCRIPTION = 'Samples the GPUs and prints one line per GPU per snapshot (or JSON lines with --json). Ctrl-C stops.'


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_source_args(p, processes=True)
    p.add_argument("--interval", type=interval, default=0.1, help="sampling interval (default 100ms)")
    p.add_argument("--every", type=interval, default=1.0, help="print every this often (default 1s)")
    p.add_argument("--count", type=int, default=0, help="stop after this many prints (default: run until Ctrl-C)")
    p.add_argument("--json", action="store_true", help="JSON lines: one snapshot per line")


def _fmt(v: float | None, scale: float = 100.0, width: int = 5, unit: str = "%") -> str:
    return f"{'-':>{width}}{' ' * len(unit)}" if v is None else f"{v * scale:>{width}.1f}{unit}"


def _line(snap: Any) -> list[str]:
    out = []
    for g in snap.gpus:
        if not g.healthy:
            out.append(f"GPU {g.identity.label:<4} LOST")
            continue
        mem = g.get("gpu_memory_used_bytes")
        out.append(
            f"GPU {g.identity.label:<4} SM active {_fmt(g.sm_active_ratio)}  tensor {_fmt(g.get('gpu_tensor_active_ratio'))}"
            f"  DRAM {_fmt(g.get('gpu_dram_active_ratio'))}  PCIe rx {_fmt(g.get('gpu_pcie_rx_bytes_per_second'), 1e-9, 6, 'GB/s')}"
            f"  | NVML util {_fmt(g.utilization_ratio)}  mem {_fmt(mem, 2**-30, 6, 'GiB')}"
            f"  {_fmt(g.power_watts, 1, 5, 'W')}  {','.join(r for r in g.throttle_reasons if r != 'gpu_idle')}"
        )
    return out


def run(args: argparse.Namespace) -> int:
    check_sim(args)
    if args.count < 0:
        raise UsageError(f"--count must be 0 (no limit) or more, not {args.count}.")
    if args.every < args.interval:
        raise UsageError("--every must not be shorter than --interval.")
    sampler = Sampler(SamplerConfig.for_interval(args.interval), simulate=args.simulate, gpus=args.gpus,
                      processes=args.processes)
    stop = {"now": False}

    def _term(*_: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, _term)
    events: deque[Any] = deque(maxlen=10_000)  # appended on the sampler thread, popped here
    sampler.subscribe(lambda snap: events.extend(snap.events))
    sampler.start()
    if sampler.simulated and not args.json:
        print(f"SIMULATED node — scenario '{sampler.simulated}' (not real GPUs)", flush=True)
    n = 0
    try:
        while not stop["now"]:
            time.sleep(args.every)
            snap = sampler.latest()
            if snap is None:
                continue
            if args.json:
                print(json.dumps(asdict(snap), default=str), flush=True)
            else:
                print(time.strftime("%H:%M:%S"), flush=False)
                for line in _line(snap):
                    print("  " + line)
                while events:
                    e = events.popleft()
                    print(f"  event: {e.message}" + (f" (x{e.count})" if e.count > 1 else ""))
                sys.stdout.flush()
            n += 1
            if args.count and n >= args.count:
                break
    except KeyboardInterrupt:
        pass
    finally:
        sampler.stop()
    return EXIT_OK
