"""CUDA driver API calls per process, counted by eBPF uprobes on libcuda.so.1, with no change to the
programs and no restart: kernel launches, graph launches, copies (count, bytes by direction) and
synchronisations with the time spent in them. Static linking of cudart defeats probes on libcudart; every
CUDA program still calls the driver, so these see C++ services, inference engines and Python alike.

Why libbpf and a built object, not bcc: bcc compiles its C at run time, so every node would need LLVM,
clang and kernel headers, and its Python binding is not on PyPI. libbpf is a small C library in every
distribution (Debian/Ubuntu `libbpf1`, RHEL `libbpf`); the probe program (bpf/cudaprobe.bpf.c) is compiled
once with clang and shipped built, and reads only its own call's arguments, never a kernel structure, so
the one object loads on any kernel with uprobes and BPF cookies (5.15+). libbpf is reached through a
thin ctypes binding (_libbpf.py, a dozen calls): the Python bindings on PyPI (pylibbpf 0.0.x, bpfmaps)
are early or cover maps only.

The probes attach to a library file (by inode), in every process that maps it: the libcuda of each GPU
process, from its /proc/PID/maps (through /proc/PID/root, so a container's own driver library counts),
and the usual driver paths when opened. Each read walks the counters map once and prunes the processes
that ended. Where BPF cannot be used (no permission, no uprobes, no libbpf, GPUSCOPE_CUDAPROBE=off),
`open()` says why in one sentence and the source stays off; nothing raises into the sampler.

    >>> probe = CudaProbe(enabled=False)
    >>> print(probe.open().reason)
    off (GPUSCOPE_CUDAPROBE=off, or the sampler's cuda_probe=False)
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import threading
from dataclasses import dataclass

from .._records import Capability, ProcessRecord

__all__ = ["DIRECTIONS", "CudaCounters", "CudaProbe", "symbol_offsets"]

log = logging.getLogger("gpuscope.cudaprobe")

OBJECT = os.path.join(os.path.dirname(__file__), "bpf", "cudaprobe.bpf.o")

#: Copy directions, in the order of the BPF counters. 'other': cuMemcpy / cuMemcpyAsync, whose direction
#: the driver infers from unified addresses.
DIRECTIONS = ("h2d", "d2h", "d2d", "other")
H2D, D2H, D2D, OTHER = range(4)

_LAUNCHES = ("cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz",
             "cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel_ptsz")
_GRAPHS = ("cuGraphLaunch", "cuGraphLaunch_ptsz")
#: (entry point, direction, 1-based argument holding the byte count); the _ptds/_ptsz twins are the
#: per-thread-default-stream builds (nvcc --default-stream per-thread).
_COPIES: tuple[tuple[str, int, int], ...] = tuple(
    (name, d, arg)
    for sync_name, async_name, d, arg in (("cuMemcpyHtoD_v2", "cuMemcpyHtoDAsync_v2", H2D, 3),
                                          ("cuMemcpyDtoH_v2", "cuMemcpyDtoHAsync_v2", D2H, 3),
                                          ("cuMemcpyDtoD_v2", "cuMemcpyDtoDAsync_v2", D2D, 3),
                                          ("cuMemcpy", "cuMemcpyAsync", OTHER, 3),
                                          ("cuMemcpyPeer", "cuMemcpyPeerAsync", D2D, 5))
    for name in (sync_name, sync_name + "_ptds", async_name, async_name + "_ptsz"))
_COPIES_2D = ("cuMemcpy2D_v2", "cuMemcpy2D_v2_ptds", "cuMemcpy2DAsync_v2", "cuMemcpy2DAsync_v2_ptsz",
              "cuMemcpy2DUnaligned_v2", "cuMemcpy2DUnaligned_v2_ptds")
_SYNCS = ("cuStreamSynchronize", "cuStreamSynchronize_ptsz", "cuCtxSynchronize", "cuEventSynchronize")

#: Where drivers install libcuda: distributions, the NVIDIA GPU Operator's driver container, WSL.
_DRIVER_PATHS = ("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1", "/usr/lib/libcuda.so.1",
                 "/usr/lib/aarch64-linux-gnu/libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1",
                 "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/wsl/lib/libcuda.so.1")


class _Counters(ctypes.Structure):  # struct counters of cudaprobe.bpf.c
    _fields_ = [("launches", ctypes.c_uint64), ("graph_launches", ctypes.c_uint64),
                ("copies", ctypes.c_uint64 * 4), ("copy_bytes", ctypes.c_uint64 * 4),
                ("syncs", ctypes.c_uint64), ("sync_ns", ctypes.c_uint64)]


@dataclass(frozen=True, slots=True)
class CudaCounters:
    """One process's driver API calls since the probes first saw it (counters; take rates over time)."""

    launches: int
    graph_launches: int
    copies: tuple[int, int, int, int]  # by DIRECTIONS
    copy_bytes: tuple[int, int, int, int]
    syncs: int
    sync_seconds: float  # time threads spent inside synchronisations, summed over threads


def symbol_offsets(path: str, names: set[str]) -> dict[str, int]:
    """File offsets of the dynamic symbols `names` that `path` defines (an ELF64 little-endian shared
    object), for uprobes; names it does not define are left out. Raises OSError or ValueError on a file
    that is not one.

    Reading .dynsym here, once per library, instead of libbpf once per probe: libcuda is ~100 MB."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
        phoff, shoff = struct.unpack_from("<QQ", head, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 54)
        f.seek(phoff)
        loads = []
        for _ in range(phnum):
            p_type, _flags, p_offset, p_vaddr, _pa, p_filesz = struct.unpack("<IIQQQQ", f.read(phentsize)[:40])
            if p_type == 1:  # PT_LOAD
                loads.append((p_vaddr, p_offset, p_filesz))
        f.seek(shoff)
        sections = [struct.unpack("<IIQQQQIIQQ", f.read(shentsize)[:64]) for _ in range(shnum)]
        dynsym = next((s for s in sections if s[1] == 11), None)  # SHT_DYNSYM
        if dynsym is None:
            return {}
        strtab = sections[dynsym[6]]
        f.seek(strtab[4])
        strings = f.read(strtab[5])
        f.seek(dynsym[4])
        table = f.read(dynsym[5])
    out: dict[str, int] = {}
    for i in range(0, len(table) - 23, 24):
        st_name, st_info, _other, st_shndx, st_value, _size = struct.unpack_from("<IBBHQQ", table, i)
        if st_shndx == 0 or st_info & 0xF != 2 or not st_value:  # undefined, or not a function
            continue
        end = strings.find(b"\0", st_name)
        name = strings[st_name:end].decode("ascii", "replace").split("@", 1)[0]
        if name not in names or name in out:
            continue
        for vaddr, off, size in loads:
            if vaddr <= st_value < vaddr + size:
                out[name] = st_value - vaddr + off
                break
    return out


def _all_names() -> set[str]:
    return {*_LAUNCHES, *_GRAPHS, *(n for n, _, _ in _COPIES), *_COPIES_2D, *_SYNCS}


class CudaProbe:
    """The probes and their counters. `open()` once; `watch(pid)` for each GPU process (cheap after the first
    time); `read()` or `annotate(records)` once per processes tick. Thread-safe; never raises after open()."""

    name = "cudaprobe"

    def __init__(self, enabled: bool | None = None, object_path: str = OBJECT, proc_root: str = "/proc",
                 libraries: tuple[str, ...] | None = None) -> None:
        env = os.environ.get("GPUSCOPE_CUDAPROBE", "").strip().lower()
        self.enabled = enabled if enabled is not None else env not in ("0", "off", "false", "no")
        self.object_path = object_path
        self.proc_root = proc_root
        extra = tuple(p for p in os.environ.get("GPUSCOPE_LIBCUDA", "").split(os.pathsep) if p)
        self.libraries = libraries if libraries is not None else extra + _DRIVER_PATHS
        self.capability = Capability(False, "not opened")
        self._obj = None
        self._fd = -1
        self._sync_fd = -1
        self._lock = threading.Lock()
        self._attached: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) of a libcuda -> probes on it
        self._watched: set[int] = set()
        self._failed_logged: set[str] = set()
        self.calls_read = 0

    # -- lifecycle --------------------------------------------------------------------------------
    def open(self) -> Capability:
        """Load the probes (attaching them to the driver libraries found in the usual places). Returns the
        capability: supported, or the one sentence why not, which is also logged once."""
        if self._obj is not None or not self.enabled:
            if not self.enabled:
                self.capability = Capability(False, "off (GPUSCOPE_CUDAPROBE=off, or the sampler's cuda_probe=False)")
            return self.capability
        from ._libbpf import BpfError, BpfObject

        try:
            if not os.path.exists("/sys/bus/event_source/devices/uprobe/type"):
                raise BpfError("this kernel has no uprobes (CONFIG_UPROBE_EVENTS)")
            if not os.path.exists(self.object_path):
                raise BpfError(f"the probe object {self.object_path} is missing from the installation")
            self._obj = BpfObject(self.object_path)
            self._fd = self._obj.map_fd("counters")
            self._sync_fd = self._obj.map_fd("sync_start")
        except BpfError as e:
            self.close()
            self.capability = Capability(False, str(e))
            log.info("CUDA driver probes (eBPF) are off: %s", e)
            return self.capability
        self.capability = Capability(True, "")
        for path in self.libraries:
            if os.path.exists(path):
                self._attach(path)
        return self.capability

    def close(self) -> None:
        with self._lock:
            if self._obj is not None:
                self._obj.close()
            self._obj = None
            self._attached.clear()
            self._watched.clear()

    @property
    def libraries_probed(self) -> int:
        return len(self._attached)

    # -- attaching --------------------------------------------------------------------------------
    def watch(self, pid: int) -> None:
        """Probe the libcuda that process `pid` maps, if not probed yet. Never raises."""
        if self._obj is None or pid in self._watched:
            return
        self._watched.add(pid)
        if len(self._watched) > 65536:  # pids are reused: forget the old ones now and then
            self._watched = {pid}
        try:
            with open(f"{self.proc_root}/{pid}/maps", encoding="utf-8", errors="replace") as f:
                paths = {line.split(None, 5)[5].strip() for line in f
                         if "libcuda.so" in line and line.count(" ") >= 5}
        except (OSError, IndexError):
            return  # ended, or not ours to read
        for path in paths:
            if path.endswith(" (deleted)"):
                continue
            self._attach(f"{self.proc_root}/{pid}/root{path}")

    def _attach(self, path: str) -> None:
        from ._libbpf import BpfError

        try:
            st = os.stat(path)
        except OSError:
            return
        key = (st.st_dev, st.st_ino)
        with self._lock:
            if self._obj is None or key in self._attached:
                return
            self._attached[key] = 0
            try:
                offsets = symbol_offsets(path, _all_names())
            except (OSError, ValueError) as e:
                self._log_once(path, f"cannot read the symbols of {path}: {e}")
                return
            done: set[tuple[int, bool]] = set()  # one probe per address: aliases would count twice

            def attach(prog: str, name: str, cookie: int = 0, ret: bool = False) -> None:
                off = offsets.get(name)
                if off is None or (off, ret) in done:
                    return
                try:
                    self._obj.attach_uprobe(prog, path, off, cookie, ret)  # type: ignore[union-attr]
                except BpfError as e:
                    self._log_once(path + name, str(e))
                    return
                done.add((off, ret))
                self._attached[key] += 1

            for name in _LAUNCHES:
                attach("launch", name)
            for name in _GRAPHS:
                attach("graph_launch", name)
            for name, direction, arg in _COPIES:
                attach("copy", name, direction | arg << 8)
            for name in _COPIES_2D:
                attach("copy2d", name)
            for name in _SYNCS:
                attach("sync_enter", name)
                attach("sync_exit", name, ret=True)
        log.info("CUDA driver probes on %s: %d entry points", path, self._attached[key])

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._failed_logged and len(self._failed_logged) < 100:
            self._failed_logged.add(key)
            log.warning("CUDA driver probes: %s", message)

    # -- reading ----------------------------------------------------------------------------------
    def read(self) -> dict[int, CudaCounters]:
        """Every probed process's counters, by pid; processes that ended are dropped from the maps."""
        obj = self._obj
        if obj is None:
            return {}
        out: dict[int, CudaCounters] = {}
        gone: list[ctypes.c_uint32] = []
        with self._lock:
            self.calls_read += 1
            try:
                for key, v in obj.items(self._fd, ctypes.c_uint32, _Counters):
                    tgid = key.value  # type: ignore[attr-defined]
                    if not os.path.exists(f"{self.proc_root}/{tgid}"):
                        gone.append(ctypes.c_uint32(tgid))
                        continue
                    out[tgid] = CudaCounters(int(v.launches), int(v.graph_launches), tuple(v.copies),  # type: ignore[attr-defined]
                                             tuple(v.copy_bytes), int(v.syncs), v.sync_ns / 1e9)  # type: ignore[attr-defined]
                for key in gone:
                    obj.delete(self._fd, key)
                # A thread that ended inside a synchronisation leaves its start behind.
                stale = [k for k, _ in obj.items(self._sync_fd, ctypes.c_uint64, ctypes.c_uint64)
                         if not os.path.exists(f"{self.proc_root}/{k.value >> 32}")]  # type: ignore[attr-defined]
                for k in stale:
                    obj.delete(self._sync_fd, k)
            except Exception as e:  # noqa: BLE001 - a reading that fails is a gap, never a crash
                self._log_once("read", f"reading the counters failed: {e!r}")
        return out

    def annotate(self, records: list[ProcessRecord]) -> None:
        """Watch each record's process and fill its cuda_* counters from one read of the maps."""
        if self._obj is None:
            return
        for r in records:
            if r.host_visible:
                self.watch(r.pid)
        counts = self.read()
        for r in records:
            c = counts.get(r.pid)
            if c is None:
                continue
            r.cuda_launches, r.cuda_graph_launches = float(c.launches), float(c.graph_launches)
            r.cuda_copies = float(sum(c.copies))
            r.cuda_h2d_bytes, r.cuda_d2h_bytes, r.cuda_d2d_bytes, r.cuda_other_copy_bytes = (
                float(b) for b in c.copy_bytes)
            r.cuda_syncs, r.cuda_sync_seconds = float(c.syncs), c.sync_seconds
