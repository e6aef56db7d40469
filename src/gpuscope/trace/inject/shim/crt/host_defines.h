/* A stand-in for the CUDA compiler's crt/host_defines.h, for a C compiler building gpuscope's injection
 * library against NVIDIA's wheels: cuda.h's type headers include it, and only the CUDA toolkit or the
 * nvcc wheel carries it. It is searched last (-idirafter), so the real one wins wherever it exists.
 * Host code needs only these attributes to parse the type declarations. */
#ifndef GPUSCOPE_SHIM_HOST_DEFINES_H
#define GPUSCOPE_SHIM_HOST_DEFINES_H
#define __device_builtin__
#define __device_builtin_surface_type__
#define __device_builtin_texture_type__
#define __cudart_builtin__
#define __host__
#define __device__
#define __global__
#define __shared__
#define __constant__
#define __managed__
#define __forceinline__ inline __attribute__((always_inline))
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(n) __align__(n)
#define __thread__ __thread
#define __import__
#define __export__
#define __cdecl
#define __annotate__(a) __attribute__((a))
#define __location__(a) __annotate__(a)
#define CUDARTAPI
#define CUDARTAPI_CDECL
#endif
