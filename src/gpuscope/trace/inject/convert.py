"""The injection library's JSON lines -> the Kineto-compatible trace that every analysis reads.

The C library (gpuscope_inject.c) writes one `<stem>[.w<k>].inject.jsonl` per window, records shaped
like trace/cupti_backend.py's plain tuples; this builds the same document through the same
`cupti_backend.to_kineto`, so a trace of a C++ program and one of a CuPy program differ only in their
stacks: native frames here, `file(0): function` with the source line in `args.line` where `addr2line`
(binutils) finds it, else the module and the symbol that `dladdr` or the file's symbol table names.

Written beside the raw file, and the raw file removed:

    <stem>[.w<k>].pt.trace.json.gz   with the "gpuscope" key (host, pid, rank, clock pair, backend "inject")
    <stem>.gpuscope.json             the process's status, as the Python bootstrap writes it
"""

from __future__ import annotations

import glob
import gzip
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from typing import Any

import orjson

from .. import cupti_backend

RAW_SUFFIX = ".inject.jsonl"
STATUS_SUFFIX = ".inject-status.json"
_STACK_DEPTH = 24
# Frames that are never the program's own: CUPTI, the driver, the runtime, this library, libc's start.
_SYSTEM_MODULE = re.compile(r"^(libcupti|libcuda\.|libcudart|libgpuscope_inject|libnvidia-|libc\.so|libc-|"
                            r"libpthread|ld-linux|libstdc\+\+|libgcc_s)")
# The CUDA runtime linked statically into the program (nvcc's default) has its frames in the program's
# own file: its API entry points and internals are not the line to change either.
_START_FUNCTIONS = frozenset(("_start", "__libc_start_main", "__libc_start_call_main"))
_ADDRESS_LINE = re.compile(r"^0x[0-9a-fA-F]+$")
_RUNTIME_FUNCTION = re.compile(r"^(cuda[A-Z_]|cu[A-Z]|__cuda|cudart|_GLOBAL__|\?\?$|0x)")


def raw_files(out_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(out_dir), "*" + RAW_SUFFIX)))


def read_raw(path: str) -> dict[str, Any]:
    """A window's file: {"header", "stop", "records", "calls", "frames", "names", "devices"}; a ValueError
    naming the line when it is not one of ours."""
    out: dict[str, Any] = {"header": None, "stop": None, "records": [], "calls": {}, "frames": {}, "names": {},
                           "devices": {}}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = orjson.loads(line)
            except orjson.JSONDecodeError:
                raise ValueError(f"{path} line {n} is not JSON (the program ended while it was written?)") from None
            if isinstance(item, dict):
                out["header" if out["header"] is None else "stop"] = item
                continue
            what = item[0]
            if what in ("kernel", "memcpy", "memset", "sync"):
                out["records"].append(tuple(item))
            elif what in ("runtime", "driver"):
                out["records"].append(tuple(item[:7]))
                out["calls"][item[5]] = item[7]
            elif what == "frame":
                out["frames"][item[1]] = tuple(item[2:])
            elif what == "cbid":
                out["names"].setdefault(item[1], {})[item[2]] = cupti_backend.base_name(item[3])
            elif what == "device":
                out["devices"][item[1]] = item[2]
    if not isinstance(out["header"], dict) or out["header"].get("gpuscope_inject") != 1:
        raise ValueError(f"{path} is not a window of gpuscope's injection library")
    return out


class Symbols:
    """Return addresses -> their frames, innermost first, each (file, function, line): addr2line where it is
    installed (one run per module; the functions inlined at the address are frames of their own), else the
    symbol that dladdr found, else the module and the offset."""

    def __init__(self, addr2line: str | None = None) -> None:
        self.addr2line = addr2line if addr2line is not None else (shutil.which("addr2line") or "")
        self._done: dict[int, list[tuple[str, str, int]]] = {}

    def resolve(self, frames: dict[int, tuple[Any, ...]], wanted: Iterable[int]) -> None:
        by_module: dict[str, list[tuple[int, int]]] = {}
        for addr in set(wanted) - set(self._done):
            module, base, sname, _saddr = frames.get(addr, (None, 0, None, 0))
            if not module:
                self._done[addr] = [("", f"0x{addr:x}", 0)]
                continue
            fallback = sname or f"{os.path.basename(module)}+0x{addr - base:x}"
            self._done[addr] = [(module, fallback, 0)]
            if _SYSTEM_MODULE.match(os.path.basename(module)):
                continue
            # A return address is the instruction after the call: the call's own line is one byte before.
            where = addr - 1 if _elf_type(module) == 2 else addr - base - 1  # ET_EXEC: absolute addresses
            by_module.setdefault(module, []).append((addr, where))
        if not self.addr2line:
            return
        for module, pairs in by_module.items():
            # -a starts each address's answer with the address; -i adds a (function, place) pair for each
            # function inlined there, innermost first (without it the name is the outer function's while
            # the line is the inlined one's).
            try:
                done = subprocess.run([self.addr2line, "-a", "-i", "-f", "-C", "-e", module,
                                       *(f"0x{w:x}" for _, w in pairs)], capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if done.returncode != 0:
                continue
            groups: list[list[str]] = []
            for line in done.stdout.splitlines():
                if _ADDRESS_LINE.match(line):
                    groups.append([])
                elif groups:
                    groups[-1].append(line.strip())
            if len(groups) != len(pairs):
                continue
            for (addr, _), group in zip(pairs, groups, strict=True):
                known = self._done[addr][0]
                chain = []
                for func, place in zip(group[::2], group[1::2], strict=False):
                    file, _, line = place.partition(" (discriminator")[0].rpartition(":")
                    chain.append((file if file and file != "??" else known[0], func if func and func != "??"
                                  else known[1], int(line) if line.isdigit() else 0))
                if chain:
                    self._done[addr] = chain

    def __getitem__(self, addr: int) -> list[tuple[str, str, int]]:
        return self._done.get(addr, [("", f"0x{addr:x}", 0)])


def _elf_type(path: str) -> int:
    try:
        with open(path, "rb") as f:
            head = f.read(18)
    except OSError:
        return 0
    return int.from_bytes(head[16:18], "little") if head[:4] == b"\x7fELF" else 0


def native_stack(addresses: list[int], frames: dict[int, tuple[Any, ...]], symbols: Symbols,
                 exe: str = "") -> list[tuple[str, int, str, int]]:
    """One call's return addresses (innermost first) -> the program's frames as the trace writes them,
    (file, 0, function, line): CUPTI, driver, runtime and libc frames left out, and nvcc's launch stubs
    (`__device_stub__K` and the host function named after the kernel that calls it: on the H200 a
    launch's innermost program frame was the kernel's own definition line, not the line that launched it)."""
    kept: list[tuple[str, int, str, int]] = []
    stub = ""  # the launch stub just left out: its caller may be the kernel's host wrapper
    for addr in addresses:
        module = (frames.get(addr) or (None,))[0] or ""
        if _SYSTEM_MODULE.match(os.path.basename(module)):
            continue
        for file, func, line in symbols[addr]:
            if not kept and _RUNTIME_FUNCTION.match(func):
                continue  # the statically linked runtime under the program's call
            if func.startswith("__device_stub__"):
                stub = func.split("(")[0]
                continue
            wrapper, stub = stub and func.split("(")[0].rpartition("::")[2] in stub, ""
            if wrapper:  # the kernel's host wrapper (named after the kernel), which called the stub
                continue
            if func in _START_FUNCTIONS:
                continue
            kept.append((file or module, 0, func, line))
        if len(kept) >= _STACK_DEPTH:
            del kept[_STACK_DEPTH:]
            break
    if not kept and addresses and exe:
        # Unwinding stopped inside the driver: the call is the program's, its line unknown.
        kept.append((exe, 0, "(native stack not unwound)", 0))
    return kept


def to_document(raw: dict[str, Any], symbols: Symbols | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the Kineto document, the trace's "gpuscope" key) for one window."""
    header, stop = raw["header"], raw["stop"] or {}
    symbols = symbols or Symbols()
    exe = header.get("exe") or ""
    if exe:  # dladdr names the main program as it was started (./prog): the path /proc/self/exe gave
        raw["frames"] = {a: ((exe, *f[1:]) if f[0] and not os.path.isabs(f[0])
                             and os.path.basename(f[0]) == os.path.basename(exe) else f)
                         for a, f in raw["frames"].items()}
    symbols.resolve(raw["frames"], (a for addrs in raw["calls"].values() for a in addrs))
    stacks = {corr: s for corr, addrs in raw["calls"].items()
              if (s := native_stack(addrs, raw["frames"], symbols, header.get("exe", "")))}
    clock = {"start": header["start"], "stop": stop.get("stop", header["start"])}
    doc = cupti_backend.to_kineto(raw["records"], stacks, clock, raw["names"], raw["devices"])
    names = raw["names"]
    launches = sum(1 for r in raw["records"] if r[0] in ("runtime", "driver")
                   and cupti_backend._LAUNCH_CALLS.match(names.get(2 if r[0] == "runtime" else 1, {}).get(r[6], "")))
    api = header.get("api", "rules")
    budget = int(header.get("launch_budget") or 0)
    launchers: dict[str, Any] = ({"launchers": "all"} if api == "all" else {"launchers": "none"} if budget <= 0 else
                                 {"launchers": "sampled", "launch_budget": budget, "launches_sampled": launches,
                                  "launch_slices": list(stop.get("launch_slices") or [])})
    doc["gpuscope_cupti"] = {"api": api, "backend": "inject", "records": len(raw["records"]), "stacks": len(stacks),
                             "dropped_buffers": 0, "records_dropped": int(stop.get("records_dropped") or 0),
                             "refused_callback_ids": int(stop.get("refused_callback_ids") or 0),
                             "frameworks": ["cuda"], "complete": bool(stop), **launchers}
    meta = {"host": header.get("host"), "pid": header.get("pid"), "rank": header.get("rank"),
            "window": header.get("window", 0), "profiler_start_unix_ns": header["start"]["unix_ns"],
            "profiler_start_monotonic_ns": header["start"]["monotonic_ns"],
            "profiler_stop_unix_ns": clock["stop"]["unix_ns"], "cpu_ops_all_threads": False,
            "with_stack": bool(header.get("with_stack")), "backend": "inject", **launchers}
    doc["gpuscope"] = meta
    return doc, meta


def _write_gz(path: str, doc: dict[str, Any]) -> None:
    """gzip through a private temporary file, then one rename (the directory may be shared)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-", suffix=".json.gz")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=3) as z:
            z.write(orjson.dumps(doc))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _write_json(path: str, doc: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "wb") as f:
        f.write(orjson.dumps(doc))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def convert(path: str, symbols: Symbols | None = None, keep_raw: bool = False) -> dict[str, Any]:
    """One window's raw file -> its .pt.trace.json.gz beside it; the status entry of that trace."""
    raw = read_raw(path)
    doc, meta = to_document(raw, symbols)
    target = path[: -len(RAW_SUFFIX)] + ".pt.trace.json.gz"
    _write_gz(target, doc)
    if not keep_raw:
        os.unlink(path)
    return dict(meta, file=os.path.basename(target), run=raw["header"].get("run"))


def convert_run(out_dir: str, run_id: str | None = None, argv: list[str] | None = None) -> list[str]:
    """Every window this run's processes left in `out_dir` -> traces, and each process's status file as the
    Python bootstrap writes it (read by trace.run.collect). Returns the problems, one sentence each."""
    problems = []
    symbols = Symbols()
    by_stem: dict[str, list[dict[str, Any]]] = {}
    for path in raw_files(out_dir):
        try:
            head = read_raw(path)["header"]
        except (OSError, ValueError) as e:
            problems.append(str(e))
            continue
        if run_id is not None and head.get("run") != run_id:
            continue
        try:
            entry = convert(path, symbols)
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{path} could not be converted: {type(e).__name__}: {e}")
            continue
        stem = path[: -len(RAW_SUFFIX)]
        stem = re.sub(r"\.w\d+$", "", stem)
        by_stem.setdefault(stem, []).append(entry)
    for status_path in sorted(glob.glob(os.path.join(glob.escape(out_dir), "*" + STATUS_SUFFIX))):
        try:
            with open(status_path, "rb") as f:
                status = orjson.loads(f.read(1 << 16))
        except (OSError, orjson.JSONDecodeError):
            continue
        if not isinstance(status, dict) or (run_id is not None and status.get("run") != run_id):
            continue
        stem = status_path[: -len(STATUS_SUFFIX)]
        traces = sorted(by_stem.pop(stem, []), key=lambda t: t.get("window", 0))
        doc = {"run": status.get("run"), "host": status.get("host"), "pid": status.get("pid"),
               "rank": status.get("rank"), "argv": list(argv or []), "backend": "inject", "api": status.get("api"),
               "cuda_initialised_unix_ns": status.get("cuda_initialised_unix_ns"),
               "status": "written" if traces else status.get("status", "failed"),
               "traces": [{k: v for k, v in t.items() if k != "run"} for t in traces]}
        if status.get("error"):
            doc["error"] = status["error"]
        _write_json(stem + ".gpuscope.json", doc)
        os.unlink(status_path)
    return problems
