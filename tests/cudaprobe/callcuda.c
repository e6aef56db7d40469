/* Calls the driver API entry points a known number of times (tests/test_cudaprobe.py), through dlopen as
 * the CUDA runtime does. Prints, as JSON, what it did and how long its calls took by its own clock.
 * usage: callcuda LIBCUDA LAUNCHES SYNCS [HOLD_MS [wait]]
 *   LAUNCHES launches (half cuLaunchKernel, half cuLaunchKernel_ptsz, plus one cuLaunchKernelEx), two
 *   cuGraphLaunch, one copy of each kind with fixed byte counts, SYNCS synchronisations (a third each of
 *   stream, context and event), then waits HOLD_MS ms (for a test to read the counters) before exiting.
 *   With `wait`, it prints {"ready": PID} once the library is loaded and reads a line from stdin first. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
typedef int (*fn1_t)(void *);
typedef int (*fn0_t)(void);
typedef int (*copy3_t)(unsigned long long, unsigned long long, size_t);
typedef int (*copy4_t)(unsigned long long, unsigned long long, size_t, void *);
typedef int (*peer_t)(unsigned long long, void *, unsigned long long, void *, size_t);
typedef int (*ex_t)(const void *, void *, void **, void **);

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void *sym(void *h, const char *n) { void *p = dlsym(h, n); if (!p) { fprintf(stderr, "no %s\n", n); exit(2); } return p; }

int main(int argc, char **argv) {
	if (argc < 4) { fprintf(stderr, "usage: callcuda LIBCUDA LAUNCHES SYNCS [HOLD_MS [wait]]\n"); return 2; }
	void *h = dlopen(argv[1], RTLD_NOW);
	if (!h) { fprintf(stderr, "%s\n", dlerror()); return 2; }
	long launches = atol(argv[2]), syncs = atol(argv[3]), hold = argc > 4 ? atol(argv[4]) : 0;
	launch_t lk = sym(h, "cuLaunchKernel"), lkp = sym(h, "cuLaunchKernel_ptsz");
	ex_t lkx = sym(h, "cuLaunchKernelEx");
	fn1_t graph = sym(h, "cuGraphLaunch"), ss = sym(h, "cuStreamSynchronize"), es = sym(h, "cuEventSynchronize");
	fn0_t cs = sym(h, "cuCtxSynchronize");
	copy3_t htod = sym(h, "cuMemcpyHtoD_v2"), dtoh = sym(h, "cuMemcpyDtoH_v2"), dtod = sym(h, "cuMemcpyDtoD_v2");
	copy3_t cpy = sym(h, "cuMemcpy");
	copy4_t htoda = sym(h, "cuMemcpyHtoDAsync_v2"), dtoha = sym(h, "cuMemcpyDtoHAsync_v2"), cpya = sym(h, "cuMemcpyAsync");
	peer_t peer = sym(h, "cuMemcpyPeer");
	fn1_t c2d = sym(h, "cuMemcpy2D_v2");
	if (argc > 5 && !strcmp(argv[5], "wait")) {
		char line[16];
		printf("{\"ready\": %d}\n", getpid());
		fflush(stdout);
		if (!fgets(line, sizeof line, stdin)) return 3;
	}
	printf("{\"pid\": %d", getpid());
	double t0 = now();
	for (long i = 0; i < launches; i++)
		(i & 1 ? lkp : lk)(0, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0);
	double t1 = now();
	lkx(0, 0, 0, 0);
	graph(0); graph(0);
	htod(0, 0, 1000); htoda(0, 0, 2000, 0);          /* h2d 3000 */
	dtoh(0, 0, 30000); dtoha(0, 0, 40000, 0);        /* d2h 70000 */
	dtod(0, 0, 500); peer(0, 0, 0, 0, 700);       /* d2d 1200 */
	cpy(0, 0, 11); cpya(0, 0, 22, 0);             /* other 33 */
	struct { size_t sx, sy; int st; const void *sh; unsigned long long sd; void *sa; size_t sp;
	         size_t dx, dy; int dt; void *dh; unsigned long long dd; void *da; size_t dp; size_t w, hgt; } m;
	memset(&m, 0, sizeof m); m.st = 1; m.dt = 2; m.w = 64; m.hgt = 10;    /* h2d 640 */
	c2d(&m);
	double slept = 0, smax = 0;
	for (long i = 0; i < syncs; i++) {
		double a = now();
		if (i % 3 == 0) ss(0); else if (i % 3 == 1) cs(); else es(0);
		double d = now() - a;
		slept += d; if (d > smax) smax = d;
	}
	printf(", \"launches\": %ld, \"launch_seconds\": %.9f, \"syncs\": %ld, \"sync_seconds\": %.9f, "
	       "\"sync_max_seconds\": %.9f}\n", launches + 1, t1 - t0, syncs, slept, smax);
	fflush(stdout);
	if (hold > 0) usleep(hold * 1000);
	return 0;
}
