"""Which GPU frameworks a process uses, from the shared objects it has loaded (its /proc/PID/maps) and,
where those cannot be read, its command line: so that a fix can be said in the program's own words
(gpuscope.diagnose.advice).

The names: torch, jax (jaxlib, xla_extension, the CUDA plugin), tensorflow, cupy, numba, triton,
cuda-python (cuda.bindings, cuda.core) and cuda: a process that loaded the CUDA runtime or driver and
none of the others (a CUDA C++ program). Nothing is imported and nothing runs in the process: its maps
are read once, bounded, and a process that ends meanwhile, refuses us (another user's, without
CAP_SYS_PTRACE) or maps files with odd bytes in their names gives what could be read, never an error.

Standard library only, and no gpuscope import: the CUPTI tracer loads this file by its path inside the
traced program (`of_this_process`), where gpuscope need not be installed.

    >>> detect("7f00-7f01 r-xp 00000000 08:01 42  /venv/lib/python3.12/site-packages/torch/lib/libtorch_cpu.so")
    ('torch',)
    >>> detect("", cmdline=["torchrun", "--nproc-per-node=8", "train.py"])
    ('torch',)
"""

from __future__ import annotations

import os
import re
import sys

__all__ = ["FRAMEWORKS", "MAX_MAPS_BYTES", "detect", "from_cmdline", "from_modules", "of_this_process", "read"]

#: Every name `detect` gives, in the order it gives them.
FRAMEWORKS = ("torch", "jax", "tensorflow", "cupy", "numba", "triton", "cuda-python", "cuda")

#: A process's maps are read up to this much. A CUDA PyTorch process maps a few thousand files (well under
#: 2 MiB of text); past this the rest is anonymous JIT memory, which names nothing.
MAX_MAPS_BYTES = 16 << 20

# On a mapped file's path (its directories and name). Site-packages layouts of pip, conda and system
# packages, and the libraries each framework loads itself.
_BY_PATH: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("torch", re.compile(r"/torch/(_C\b|lib/)|/libtorch(_cpu|_cuda|_python|_global_deps)?\.so|/libc10(_cuda)?\.so")),
    ("jax", re.compile(r"/jaxlib/|/xla_extension[.\w-]*\.so|/jax_plugins/|/jax_cuda\d*_(plugin|pjrt)/")),
    ("tensorflow", re.compile(r"/libtensorflow(_framework|_cc)?\.so|/tensorflow/(python|compiler|core)/.*\.so")),
    ("cupy", re.compile(r"/cupy(_backends)?/.*\.so|/libcupy\w*\.so")),
    ("numba", re.compile(r"/numba(_cuda)?/.*\.so")),
    ("triton", re.compile(r"/triton/_C/|/libtriton\.so|/\.triton/cache/")),
    # cuda-python's modules live in site-packages/cuda/...; the toolkit's own /usr/local/cuda/lib64 must not match.
    ("cuda-python", re.compile(r"/cuda/(bindings|core|_cuda|_lib)/|/cuda/c?cuda(rt)?\.cpython|/cuda_bindings/")),
)
_CUDA_LIB = re.compile(r"/lib(cudart|cuda)\.so")

# Command lines that name their framework: launchers (torchrun, deepspeed, accelerate) and `python -m`.
_LAUNCHERS = {"torchrun": "torch", "deepspeed": "torch", "accelerate": "torch", "vllm": "torch",
              "lightning": "torch"}
_MODULE_ARG = re.compile(r"^(torch|jax|tensorflow|cupy|numba|triton)(\.|$)")

# Top-level modules (sys.modules) -> the framework, for `from_modules`.
_MODULES = {"torch": "torch", "jax": "jax", "jaxlib": "jax", "tensorflow": "tensorflow", "cupy": "cupy",
            "cupy_backends": "cupy", "numba": "numba", "numba_cuda": "numba", "triton": "triton",
            "cuda.bindings": "cuda-python", "cuda.core": "cuda-python", "cuda.cudart": "cuda-python",
            "cuda.cuda": "cuda-python"}


def _ordered(found: set[str]) -> tuple[str, ...]:
    if found - {"cuda"}:
        found = found - {"cuda"}  # "cuda" means: CUDA and none of the frameworks
    return tuple(f for f in FRAMEWORKS if f in found)


def _paths(maps_text: str) -> set[str]:
    """The distinct files mapped: the sixth field onwards of each line (a path may hold spaces)."""
    out = set()
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            path = parts[5]
            out.add(path[:-10] if path.endswith(" (deleted)") else path)
    return out


def detect(maps_text: str, cmdline: list[str] | tuple[str, ...] = ()) -> tuple[str, ...]:
    """The frameworks in a process's /proc/PID/maps text, in FRAMEWORKS order; `cmdline` (its arguments)
    is read only when the maps name no file at all (they could not be read). () when nothing is known."""
    found: set[str] = set()
    paths = _paths(maps_text)
    for path in paths:
        for name, pattern in _BY_PATH:
            if name not in found and pattern.search(path):
                found.add(name)
        if _CUDA_LIB.search(path):
            found.add("cuda")
    if not paths:
        found.update(from_cmdline(cmdline))
    return _ordered(found)


def from_cmdline(argv: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """What a command line alone says: a launcher that implies its framework (torchrun, deepspeed,
    accelerate), or `python -m <framework>...`. Weaker than the maps: a script's name says nothing."""
    found: set[str] = set()
    args = [a for a in argv[:64] if isinstance(a, str)]
    for i, arg in enumerate(args[:2]):
        base = os.path.basename(arg)
        if _LAUNCHERS.get(base):
            found.add(_LAUNCHERS[base])
        if i == 0 and not base.startswith("python"):
            break
    for i in range(len(args) - 1):
        m = _MODULE_ARG.match(args[i + 1]) if args[i] == "-m" else None
        if m:
            found.add(m.group(1))
    return _ordered(found)


def from_modules(names: object) -> tuple[str, ...]:
    """The frameworks among imported module names (sys.modules' keys), for a process reading itself."""
    found = set()
    for name in names:  # type: ignore[attr-defined]
        if not isinstance(name, str):
            continue
        head, _, rest = name.partition(".")
        hit = _MODULES.get(head) if head != "cuda" else _MODULES.get(f"cuda.{rest.partition('.')[0]}")
        if hit:
            found.add(hit)
    return _ordered(found)


def _read_bounded(path: str, limit: int) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except (OSError, ValueError):  # gone (ENOENT, ESRCH mid-read), not ours (EACCES), not a file
        return None


def _cmdline(pid: int, proc_root: str) -> list[str]:
    raw = _read_bounded(f"{proc_root}/{pid}/cmdline", 64 << 10) or b""
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]


def read(pid: int, proc_root: str = "/proc") -> tuple[str, ...]:
    """The frameworks of process `pid`, from its maps (at most MAX_MAPS_BYTES), else its command line.
    Never raises: a process that is gone or not readable gives what its command line says, or ()."""
    raw = _read_bounded(f"{proc_root}/{pid}/maps", MAX_MAPS_BYTES)
    text = raw.decode("utf-8", "replace") if raw else ""
    return detect(text, _cmdline(pid, proc_root) if not text else ())


def of_this_process() -> tuple[str, ...]:
    """The frameworks of the calling process: its own maps and the modules it imported (a framework
    imported as pure Python, without its extension loaded yet, is still named)."""
    try:
        raw = _read_bounded("/proc/self/maps", MAX_MAPS_BYTES)
        found = set(detect(raw.decode("utf-8", "replace") if raw else "", sys.argv if not raw else ()))
        found.update(from_modules(list(sys.modules)))
        return _ordered(found)
    except Exception:  # inside someone's program: never raise
        return ()
