/* A stand-in for libcuda.so.1 where there is no NVIDIA driver (tests/test_cudaprobe.py): the driver API
 * entry points the eBPF probes attach to, with the real signatures (cuda.h, CUDA 12), doing nothing but
 * a synchronisation that sleeps for the time the test asks through FAKECUDA_SYNC_US. Only the probes'
 * view of the calls is under test; the real driver's is tests/gpu/test_cudaprobe_gpu.py. */
#include <stddef.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUfunction, *CUstream, *CUevent, *CUcontext, *CUgraphExec;
typedef struct { size_t srcXInBytes, srcY; int srcMemoryType; const void *srcHost; CUdeviceptr srcDevice;
                 void *srcArray; size_t srcPitch; size_t dstXInBytes, dstY; int dstMemoryType; void *dstHost;
                 CUdeviceptr dstDevice; void *dstArray; size_t dstPitch; size_t WidthInBytes, Height; } CUDA_MEMCPY2D;
typedef struct CUlaunchConfig_st CUlaunchConfig;

static void nap(void) {
	const char *us = getenv("FAKECUDA_SYNC_US");
	long n = us ? atol(us) : 0;
	if (n > 0) {
		struct timespec t = { n / 1000000, (n % 1000000) * 1000 };
		nanosleep(&t, NULL);
	}
}

#define KEEP __attribute__((visibility("default"), noinline))
KEEP CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                             unsigned bz, unsigned shm, CUstream s, void **params, void **extra) {
	__asm__ volatile("" ::: "memory"); return 0; }
KEEP CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                  unsigned bz, unsigned shm, CUstream s, void **params, void **extra) {
	__asm__ volatile("" ::: "memory"); return 0; }
KEEP CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
	__asm__ volatile("" ::: "memory"); return 0; }
KEEP CUresult cuGraphLaunch(CUgraphExec g, CUstream s) { __asm__ volatile("" ::: "memory"); return 0; }
KEEP CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { __asm__ volatile("" ::: "memory"); return 0; }
KEEP CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { __asm__ volatile("" ::: "memory"); return 0; }
KEEP CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) { __asm__ volatile("" ::: "memory"); return 0; }
KEEP CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
	__asm__ volatile("" ::: "memory"); return 0; }
KEEP CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
	__asm__ volatile("" ::: "memory"); return 0; }
KEEP CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) { __asm__ volatile("" ::: "memory"); return 0; }
KEEP CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
	__asm__ volatile("" ::: "memory"); return 0; }
KEEP CUresult cuMemcpyPeer(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n) {
	__asm__ volatile("" ::: "memory"); return 0; }
KEEP CUresult cuMemcpy2D_v2(const CUDA_MEMCPY2D *p) { __asm__ volatile("" ::: "memory"); return 0; }
KEEP CUresult cuStreamSynchronize(CUstream s) { nap(); return 0; }
KEEP CUresult cuCtxSynchronize(void) { nap(); return 0; }
KEEP CUresult cuEventSynchronize(CUevent e) { nap(); return 0; }
/* an entry point the probes do not know: never counted */
KEEP CUresult cuInit(unsigned flags) { return 0; }
