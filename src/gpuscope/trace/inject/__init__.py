"""Tracing CUDA programs that are not Python: gpuscope's CUDA injection library, built where it runs.

`gpuscope trace -- ./a_cuda_binary` starts the program with CUDA_INJECTION64_PATH naming
libgpuscope_inject.so (gpuscope_inject.c, beside this file): the CUDA driver loads it at cuInit and
calls its InitializeInjection(), which subscribes CUPTI and writes each window's records as JSON lines;
`convert.py` turns them into the Kineto-compatible trace after the program exits.

The library is compiled at first use with the system C compiler (`cc`, or $CC) against the CUPTI
headers and libcupti of NVIDIA's wheels (`pip install nvidia-cuda-cupti-cu12 nvidia-cuda-runtime-cu12`,
the second for cuda.h, which CUPTI's headers include), or of a CUDA toolkit's extras/CUPTI, or of
$GPUSCOPE_CUPTI_ROOT; headers and library always from the same place, since the record layouts are
CUPTI's own version's. It goes into the user's cache directory, keyed by a hash of the source, the
CUPTI it was built against and the compiler, so an upgrade of either builds it again. No CUDA toolkit
is needed: the wheels carry everything.

    >>> why_not = availability().get("reason")   # "" where injection works, else one sentence  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import Unavailable

SOURCE = Path(__file__).resolve().parent / "gpuscope_inject.c"
#: crt/host_defines.h for builds against the wheels, which lack it (searched last: a real one wins).
SHIM = Path(__file__).resolve().parent / "shim"
LIBRARY = "libgpuscope_inject.so"
#: How the record structs are named in each CUPTI release changes (CUpti_ActivityKernel9 .. 13); the
#: builder names the newest one its headers define.
_STRUCTS = {"GS_KERNEL_T": "Kernel", "GS_MEMCPY_T": "Memcpy", "GS_MEMSET_T": "Memset",
            "GS_SYNC_T": "Synchronization", "GS_DEVICE_T": "Device"}
_WHEELS = "pip install nvidia-cuda-cupti-cu12 nvidia-cuda-runtime-cu12"


class InjectUnavailable(Unavailable):
    """Injection cannot work here: one sentence saying why (no compiler, no CUPTI, no driver, ...)."""


@dataclass(frozen=True)
class Cupti:
    """One CUPTI: its include directory, the directory with cuda.h, its libcupti and where it was found."""

    include: str
    cuda_include: str
    library: str
    where: str


def _libcupti_in(directory: str) -> str | None:
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return None
    exact = [n for n in names if re.fullmatch(r"libcupti\.so(\.\d+)*", n)]
    return os.path.join(directory, min(exact, key=len)) if exact else None


def _candidates() -> list[tuple[str, str]]:
    """(CUPTI root, what it is) in the order they are tried."""
    out = []
    root = os.environ.get("GPUSCOPE_CUPTI_ROOT")
    if root:
        out.append((root, "$GPUSCOPE_CUPTI_ROOT"))
    for entry in sys.path:  # NVIDIA's wheels: nvidia/cuda_cupti (cu12) or nvidia/cu13
        base = os.path.join(entry or ".", "nvidia")
        for sub in ("cuda_cupti", "cu13", "cu12"):
            if os.path.isfile(os.path.join(base, sub, "include", "cupti.h")):
                out.append((os.path.join(base, sub), f"the {sub} wheel in {entry}"))
    homes = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    homes += sorted((str(p) for p in Path("/usr/local").glob("cuda-*")), reverse=True)
    for home in homes:
        if home:
            out.append((os.path.join(home, "extras", "CUPTI"), f"the CUDA toolkit in {home}"))
    return out


def _cuda_h(root: str) -> str | None:
    """Where cuda.h is for a CUPTI root: beside cupti.h, the runtime wheel next to it, or the toolkit's."""
    tries = [os.path.join(root, "include"), os.path.join(os.path.dirname(root), "cuda_runtime", "include"),
             os.path.join(os.path.dirname(os.path.dirname(root)), "include")]
    tries += [os.path.join(os.path.dirname(e), "include") for e in (shutil.which("nvcc") or "",) if e]
    return next((d for d in tries if os.path.isfile(os.path.join(d, "cuda.h"))), None)


def api_version(include: str) -> int:
    """CUPTI_API_VERSION of a CUPTI's headers (0 when unreadable)."""
    try:
        text = Path(include, "cupti_version.h").read_text(errors="replace")
    except OSError:
        return 0
    m = re.search(r"#define\s+CUPTI_API_VERSION\s+(\d+)", text)
    return int(m.group(1)) if m else 0


def find_cupti() -> Cupti:
    """$GPUSCOPE_CUPTI_ROOT, else the newest CUPTI found with headers, cuda.h and libcupti together (a newer
    CUPTI traces programs built with an older CUDA, not the other way round); InjectUnavailable saying
    what is missing."""
    missing, usable = [], []
    for root, where in _candidates():
        include = os.path.join(root, "include")
        if not os.path.isfile(os.path.join(include, "cupti.h")):
            continue
        library = next((p for p in (_libcupti_in(os.path.join(root, d)) for d in ("lib", "lib64")) if p), None)
        cuda_include = _cuda_h(root)
        if library is None:
            missing.append(f"{where} has CUPTI's headers but no libcupti.so")
        elif cuda_include is None:
            missing.append(f"{where} has CUPTI but no cuda.h beside it (pip install nvidia-cuda-runtime-cu12)")
        else:
            found = Cupti(include, cuda_include, library, where)
            if where == "$GPUSCOPE_CUPTI_ROOT":
                return found
            usable.append(found)
    if usable:
        return max(usable, key=lambda c: api_version(c.include))  # max() keeps the first of equals
    if missing:
        raise InjectUnavailable(f"no usable CUPTI: {missing[0]}.")
    raise InjectUnavailable(f"no CUPTI headers and library were found ({_WHEELS}, or set GPUSCOPE_CUPTI_ROOT "
                            "to a CUPTI directory with include/ and lib/).")


def compiler() -> str:
    """The C compiler to build with ($CC, else cc, gcc or clang); InjectUnavailable when there is none."""
    for name in ([os.environ["CC"]] if os.environ.get("CC") else []) + ["cc", "gcc", "clang"]:
        path = shutil.which(name.split()[0])
        if path:
            return path
    raise InjectUnavailable("no C compiler (cc, gcc or clang) to build the injection library with; "
                            "install one (apt-get install gcc) or set CC.")


def struct_names(include: str) -> dict[str, str]:
    """-D values naming the newest record struct of each kind that this CUPTI's cupti_activity.h defines."""
    try:
        text = Path(include, "cupti_activity.h").read_text(errors="replace")
    except OSError as e:
        raise InjectUnavailable(f"cannot read {include}/cupti_activity.h: {e.strerror or e}.") from None
    out = {}
    for macro, kind in _STRUCTS.items():
        versions = [int(v or 1) for v in re.findall(rf"}}\s*CUpti_Activity{kind}(\d*)\s*;", text)]
        if not versions:
            raise InjectUnavailable(f"{include}/cupti_activity.h defines no CUpti_Activity{kind} record: "
                                    "a CUPTI gpuscope does not know.")
        top = max(versions)
        out[macro] = f"CUpti_Activity{kind}{top if top > 1 else ''}"
    return out


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpuscope" / "inject"


def build(cupti: Cupti | None = None, cc: str | None = None, into: Path | None = None) -> str:
    """The injection library's path, compiled now unless a build of the same source, CUPTI and compiler is
    already there. InjectUnavailable (one sentence, the compiler's first error) when it cannot be built."""
    cupti = cupti or find_cupti()
    cc = cc or compiler()
    defines = struct_names(cupti.include)
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, (SHIM / "crt" / "host_defines.h").read_bytes(), cupti.include.encode(), cupti.cuda_include.encode(),
                                     cupti.library.encode(), cc.encode(),
                                     repr(sorted(defines.items())).encode()])).hexdigest()[:16]
    out_dir = (into or cache_dir()) / key
    target = out_dir / LIBRARY
    if target.is_file():
        return str(target)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InjectUnavailable(f"cannot create {out_dir} for the injection library: {e.strerror or e}.") from None
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".build-", suffix=".so")
    os.close(fd)
    argv = [cc, "-shared", "-fPIC", "-O2", "-std=gnu11", "-fvisibility=hidden", "-Wall",
            "-I", cupti.include, "-I", cupti.cuda_include, "-idirafter", str(SHIM), *(f"-D{k}={v}" for k, v in defines.items()),
            str(SOURCE), "-o", tmp, cupti.library, f"-Wl,-rpath,{os.path.dirname(cupti.library)}",
            "-lpthread", "-ldl"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        raise InjectUnavailable(f"the C compiler {cc} could not run: {e}.") from None
    if done.returncode != 0:
        os.unlink(tmp)
        first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:300])
        raise InjectUnavailable(f"the injection library did not compile against {cupti.where}: {first.strip()}")
    os.replace(tmp, target)
    return str(target)


def driver() -> str:
    """The NVIDIA driver's libcuda, loaded to check that it is there; InjectUnavailable when it is not."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        why = str(e).rpartition(": ")[2] or "not found"
        raise InjectUnavailable(f"no NVIDIA driver here (libcuda.so.1 cannot be loaded: {why}).") from None
    return "libcuda.so.1"


def availability(build_it: bool = True) -> dict[str, Any]:
    """Whether injection works on this machine, for `gpuscope doctor`: {"works", "reason", "library",
    "cupti", "compiler"}; each missing part named (compiler, CUPTI, driver), the first one as the reason."""
    out: dict[str, Any] = {"works": False, "reason": "", "library": "", "cupti": "", "compiler": ""}
    problems = []
    cupti = cc = None
    try:
        cc = out["compiler"] = compiler()
    except InjectUnavailable as e:
        problems.append(str(e))
    try:
        cupti = find_cupti()
        out["cupti"] = cupti.where
    except InjectUnavailable as e:
        problems.append(str(e))
    if cupti and cc and build_it:
        try:
            out["library"] = build(cupti, cc)
        except InjectUnavailable as e:
            problems.append(str(e))
    try:
        driver()
    except InjectUnavailable as e:
        problems.append(str(e))
    out["works"] = not problems
    out["reason"] = "; ".join(p.rstrip(".") for p in problems) + ("." if problems else "")
    return out


_PYTHON = re.compile(r"^(python|pypy)[\d.]*(-dbg|d|m|u)*$")
# Programs that start others (a shell, a launcher): what they start may well be Python, which the
# bootstrap traces with its frameworks' own profilers; `--backend inject` still traces them by injection.
_WRAPPERS = frozenset(("sh", "bash", "dash", "zsh", "ksh", "fish", "env", "nohup", "time", "timeout", "nice",
                       "taskset", "numactl", "stdbuf", "chrt", "ionice", "setsid", "xargs", "srun", "mpirun",
                       "mpiexec", "orterun", "prterun", "su", "sudo", "runuser", "busybox"))


def is_native(program: str) -> bool:
    """Whether `program` (a path or a name on PATH) is an ELF executable that is not a Python interpreter nor a
    shell or launcher: those are traced by injection; Python programs, scripts (#!) and launchers by the
    bootstrap."""
    path = program if os.sep in program else shutil.which(program)
    if not path:
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    if head != b"\x7fELF":
        return False
    names = {os.path.basename(path), os.path.basename(os.path.realpath(path))}
    if any(_PYTHON.match(n) or n in _WRAPPERS for n in names):
        return False
    return os.path.realpath(path) != os.path.realpath(sys.executable)
