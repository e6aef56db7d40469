#!/bin/sh
# Rebuilds cudaprobe.bpf.o from cudaprobe.bpf.c (clang >= 14 with the BPF target, libbpf's headers from
# libbpf-dev). The object is shipped built; tests/test_cudaprobe.py rebuilds it where clang is present and
# checks that the programs and maps match the shipped one.
set -eu
out=$(realpath -m "${1:-$(dirname "$0")/cudaprobe.bpf.o}")
cc=${CLANG:-$(command -v clang || command -v clang-14 || command -v clang-15 || command -v clang-16)}
# From its own folder, its path mapped to ".": the file name recorded in the object's BTF line info is then
# the same wherever the tree lies.
cd "$(dirname "$0")"
"$cc" -O2 -g -fdebug-prefix-map="$(pwd)=." -target bpf -D__TARGET_ARCH_x86 -I/usr/include/x86_64-linux-gnu \
  -c cudaprobe.bpf.c -o "$out"
# Strip the DWARF (BTF stays): a smaller object and a byte-stable build independent of the build path.
llvm-strip -g "$out" 2>/dev/null || llvm-strip-14 -g "$out" 2>/dev/null || true
