"""A thin ctypes binding of the few libbpf calls the CUDA probes need: open and load a built BPF object,
attach its programs as uprobes, read and prune a hash map. libbpf (libbpf.so.1, Debian/Ubuntu `libbpf1`,
RHEL `libbpf`) does the ELF, relocation, symbol lookup and kernel-feature work; this only calls it.

Every failure is a `BpfError` carrying one sentence (libbpf's own last message appended where it has one).

`GPUSCOPE_LIBBPF` names the library file to load (a libbpf unpacked from a distribution package into a
private folder); a libelf.so.1 beside it is loaded first so the dynamic linker finds it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
from collections.abc import Iterator

__all__ = ["BpfError", "BpfObject", "load_libbpf"]

_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()
_messages: list[str] = []  # libbpf's last warnings, kept for the sentence of a failure

# libbpf_print_fn_t: int (*)(enum libbpf_print_level level, const char *fmt, va_list ap); va_list is a pointer.
_PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_print_cb = None  # kept alive for as long as libbpf may call it


class BpfError(Exception):
    """The BPF facility cannot be used here; str() is one sentence a user can act on."""


class _UprobeOpts(ctypes.Structure):
    # struct bpf_uprobe_opts of libbpf 1.0/1.1; `sz` tells newer versions which fields are set.
    _fields_ = [("sz", ctypes.c_size_t), ("ref_ctr_offset", ctypes.c_size_t), ("bpf_cookie", ctypes.c_uint64),
                ("retprobe", ctypes.c_bool), ("func_name", ctypes.c_char_p)]


def load_libbpf() -> ctypes.CDLL:
    """libbpf.so.1, loaded once. Raises BpfError where it is not installed."""
    global _lib, _print_cb
    with _lib_lock:
        if _lib is not None:
            return _lib
        path = os.environ.get("GPUSCOPE_LIBBPF") or ""
        try:
            if path:
                elf = os.path.join(os.path.dirname(path), "libelf.so.1")
                if os.path.exists(elf):
                    ctypes.CDLL(elf, mode=ctypes.RTLD_GLOBAL)
                lib = ctypes.CDLL(path, use_errno=True)
            else:
                lib = ctypes.CDLL(ctypes.util.find_library("bpf") or "libbpf.so.1", use_errno=True)
        except OSError as e:
            raise BpfError(f"libbpf is not installed ({e}); install the distribution's libbpf1 (Debian, Ubuntu) or "
                           "libbpf (RHEL) package, or point GPUSCOPE_LIBBPF at a libbpf.so.1") from None
        _declare(lib)
        libc = ctypes.CDLL(None)
        vsnprintf = libc.vsnprintf
        vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p]

        def _print(level: int, fmt: bytes, ap: int) -> int:
            try:
                buf = ctypes.create_string_buffer(8192)
                vsnprintf(buf, 8192, fmt, ap)
                if level <= 1:  # warnings and info; debug output is dropped
                    text = buf.value.decode("utf-8", "replace").strip()
                    _messages.append(text[len("libbpf: "):] if text.startswith("libbpf: ") else text)
                    del _messages[:-8]
            except Exception:  # noqa: BLE001 - a callback from C must never raise
                pass
            return 0

        _print_cb = _PRINT_FN(_print)
        lib.libbpf_set_print(_print_cb)
        _lib = lib
        return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    for name, res, args in (
        ("libbpf_set_print", p, [_PRINT_FN]),
        ("bpf_object__open_file", p, [ctypes.c_char_p, p]),
        ("bpf_object__load", i, [p]),
        ("bpf_object__close", None, [p]),
        ("bpf_object__find_program_by_name", p, [p, ctypes.c_char_p]),
        ("bpf_object__find_map_by_name", p, [p, ctypes.c_char_p]),
        ("bpf_map__fd", i, [p]),
        ("bpf_program__attach_uprobe_opts", p, [p, i, ctypes.c_char_p, sz, ctypes.POINTER(_UprobeOpts)]),
        ("bpf_link__destroy", i, [p]),
        ("bpf_map_get_next_key", i, [i, p, p]),
        ("bpf_map_lookup_elem", i, [i, p, p]),
        ("bpf_map_delete_elem", i, [i, p]),
    ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


def _why(what: str, err: int) -> str:
    """One sentence for errno `err` of `what`, with libbpf's last message where it said something."""
    hint = {errno.EPERM: "no permission: BPF needs root, or CAP_BPF with CAP_PERFMON",
            errno.EACCES: "no permission (the kernel refused the program or the file)",
            errno.ENOENT: "not found",
            errno.EINVAL: "the kernel rejected it (too old, or without uprobes or BPF cookies)",
            errno.ENOSYS: "this kernel has no bpf() system call",
            errno.EOPNOTSUPP: "not supported by this kernel"}.get(err, os.strerror(err) if err else "failed")
    return f"{what}: {hint}" + (f" (libbpf: {last[:200]})" if (last := _last_reason()) else "")


def _last_reason() -> str:
    """libbpf's reason for the last failure: the verifier's last line before its statistics where it printed
    a program's load log, else its last message."""
    for m in reversed(_messages):
        lines = [x.strip() for x in m.splitlines() if x.strip()]
        for i, line in enumerate(lines):
            if line.startswith("processed ") and i > 0:
                return lines[i - 1]
    return next((m.strip().splitlines()[-1] for m in reversed(_messages) if m.strip()), "")


class BpfObject:
    """A loaded BPF object file: its programs attach as uprobes, its maps are read by name."""

    def __init__(self, path: str) -> None:
        self._lib = lib = load_libbpf()
        _messages.clear()
        obj = lib.bpf_object__open_file(path.encode(), None)
        if not obj:
            raise BpfError(_why(f"cannot open the BPF object {path}", ctypes.get_errno()))
        if lib.bpf_object__load(obj) != 0:
            err = ctypes.get_errno()
            lib.bpf_object__close(obj)
            raise BpfError(_why("the kernel did not load the CUDA probes", err))
        self._obj: int | None = obj
        self._links: list[int] = []

    def attach_uprobe(self, program: str, binary: str, offset: int, cookie: int = 0,
                      retprobe: bool = False) -> int:
        """Attach `program` at file offset `offset` of the ELF file `binary` (a function's entry, or its
        returns with `retprobe`), in every process that maps it. Returns the link."""
        lib = self._lib
        prog = lib.bpf_object__find_program_by_name(self._obj, program.encode())
        if not prog:
            raise BpfError(f"the CUDA probe object has no program {program!r}")
        opts = _UprobeOpts(ctypes.sizeof(_UprobeOpts), 0, cookie, retprobe, None)
        _messages.clear()
        link = lib.bpf_program__attach_uprobe_opts(prog, -1, binary.encode(), offset, ctypes.byref(opts))
        if not link:
            raise BpfError(_why(f"cannot attach a uprobe at offset {offset:#x} of {binary}", ctypes.get_errno()))
        self._links.append(link)
        return link

    def map_fd(self, name: str) -> int:
        m = self._lib.bpf_object__find_map_by_name(self._obj, name.encode())
        if not m:
            raise BpfError(f"the CUDA probe object has no map {name!r}")
        return int(self._lib.bpf_map__fd(m))

    def items(self, fd: int, key_type: type, value_type: type) -> Iterator[tuple[object, object]]:
        """(key, value) of every entry of a hash map; entries deleted meanwhile are skipped."""
        lib = self._lib
        key, nxt, val = key_type(), key_type(), value_type()
        first = True
        seen = 0
        while lib.bpf_map_get_next_key(fd, None if first else ctypes.byref(key), ctypes.byref(nxt)) == 0:
            first = False
            ctypes.memmove(ctypes.byref(key), ctypes.byref(nxt), ctypes.sizeof(key_type))
            if lib.bpf_map_lookup_elem(fd, ctypes.byref(key), ctypes.byref(val)) == 0:
                out = value_type()
                ctypes.memmove(ctypes.byref(out), ctypes.byref(val), ctypes.sizeof(value_type))
                yield key_type(key.value) if hasattr(key, "value") else key, out
            seen += 1
            if seen > 1_000_000:  # a map that changes under us faster than we walk it
                return

    def delete(self, fd: int, key: object) -> None:
        self._lib.bpf_map_delete_elem(fd, ctypes.byref(key))  # type: ignore[arg-type]

    def close(self) -> None:
        """Detach every probe and unload the object (the kernel frees its maps)."""
        lib = self._lib
        for link in self._links:
            lib.bpf_link__destroy(link)
        self._links = []
        if self._obj:
            lib.bpf_object__close(self._obj)
            self._obj = None
