// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
// Uprobes on the CUDA driver API (libcuda.so.1): per process (tgid), kernel launches, graph launches,
// copies and their bytes by direction, and synchronisations with the time spent in them.
//
// Built once with `clang -O2 -g -target bpf` (gpuscope/sources/bpf/build.sh) and shipped built: nodes need
// no compiler. It reads only its own arguments (pt_regs, a user-space ABI) and user memory, never a kernel
// structure, so the same object loads on any kernel with uprobes, BPF cookies (5.15+) and BTF-less maps.
// One program serves every copy entry point: the attach cookie says the direction and where the byte
// count is (see cudaprobe.py, _COPIES).

#include <linux/bpf.h>
#include <linux/ptrace.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define DIRS 4 /* h2d, d2h, d2d, other (cuMemcpy/cuMemcpyAsync: the driver infers it from the pointers) */

struct counters {
	__u64 launches;
	__u64 graph_launches;
	__u64 copies[DIRS];
	__u64 copy_bytes[DIRS];
	__u64 syncs;
	__u64 sync_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, struct counters);
} counters SEC(".maps");

// When each thread entered a synchronisation (pid_tgid -> ns); its return adds the time.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u64);
	__type(value, __u64);
} sync_start SEC(".maps");

static __always_inline struct counters *mine(void)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	struct counters *c = bpf_map_lookup_elem(&counters, &tgid);
	if (c)
		return c;
	struct counters zero = {};
	bpf_map_update_elem(&counters, &tgid, &zero, BPF_NOEXIST);
	return bpf_map_lookup_elem(&counters, &tgid);
}

SEC("uprobe")
int launch(struct pt_regs *ctx)
{
	struct counters *c = mine();
	if (c)
		__sync_fetch_and_add(&c->launches, 1);
	return 0;
}

SEC("uprobe")
int graph_launch(struct pt_regs *ctx)
{
	struct counters *c = mine();
	if (c)
		__sync_fetch_and_add(&c->graph_launches, 1);
	return 0;
}

// cookie: direction in bits 0-7, the 1-based argument holding the byte count in bits 8-15.
SEC("uprobe")
int copy(struct pt_regs *ctx)
{
	__u64 cookie = bpf_get_attach_cookie(ctx);
	__u32 dir = cookie & 0xff;
	/* both read straight from ctx: the verifier refuses a ctx pointer the compiler moved by a branch */
	__u64 arg3 = PT_REGS_PARM3(ctx), arg5 = PT_REGS_PARM5(ctx);
	__u64 bytes = ((cookie >> 8) & 0xff) == 5 ? arg5 : arg3;
	struct counters *c = mine();
	if (!c || dir >= DIRS)
		return 0;
	__sync_fetch_and_add(&c->copies[dir], 1);
	__sync_fetch_and_add(&c->copy_bytes[dir], bytes);
	return 0;
}

// cuMemcpy2D*(const CUDA_MEMCPY2D *p, ...): the memory types and the extent live in the struct.
#define M2D_SRC_TYPE 16
#define M2D_DST_TYPE 72
#define M2D_WIDTH 112
#define M2D_HEIGHT 120

SEC("uprobe")
int copy2d(struct pt_regs *ctx)
{
	const char *p = (const char *)PT_REGS_PARM1(ctx);
	__u32 src = 0, dst = 0;
	__u64 width = 0, height = 0;
	bpf_probe_read_user(&src, sizeof(src), p + M2D_SRC_TYPE);
	bpf_probe_read_user(&dst, sizeof(dst), p + M2D_DST_TYPE);
	bpf_probe_read_user(&width, sizeof(width), p + M2D_WIDTH);
	bpf_probe_read_user(&height, sizeof(height), p + M2D_HEIGHT);
	/* CUmemorytype: 1 host, 2 device, 3 array, 4 unified */
	__u32 dir = 3;
	if (src == 1 && (dst == 2 || dst == 3))
		dir = 0;
	else if ((src == 2 || src == 3) && dst == 1)
		dir = 1;
	else if ((src == 2 || src == 3) && (dst == 2 || dst == 3))
		dir = 2;
	struct counters *c = mine();
	if (!c)
		return 0;
	__sync_fetch_and_add(&c->copies[dir], 1);
	__sync_fetch_and_add(&c->copy_bytes[dir], width * height);
	return 0;
}

SEC("uprobe")
int sync_enter(struct pt_regs *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u64 now = bpf_ktime_get_ns();
	bpf_map_update_elem(&sync_start, &id, &now, BPF_ANY);
	return 0;
}

SEC("uretprobe")
int sync_exit(struct pt_regs *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u64 *t0 = bpf_map_lookup_elem(&sync_start, &id);
	if (!t0)
		return 0; /* entered before the probes were attached */
	__u64 spent = bpf_ktime_get_ns() - *t0;
	bpf_map_delete_elem(&sync_start, &id);
	struct counters *c = mine();
	if (!c)
		return 0;
	__sync_fetch_and_add(&c->syncs, 1);
	__sync_fetch_and_add(&c->sync_ns, spent);
	return 0;
}
