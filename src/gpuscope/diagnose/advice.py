"""The fixes, said in the words of the framework the program uses: for the metric verdicts
(diagnose.rules) and for the trace findings (trace.rules) alike.

Which frameworks a process uses comes from the libraries it loaded (gpuscope._frameworks; a process
record's `frameworks`). A GPU's verdict speaks to the frameworks of the processes on it; a trace's
findings to the traced process's. Where nothing is known (a process in another pid namespace, a store
that kept no names, an old recording) or the program is CUDA C++, the fix is the CUDA-level one.
Several frameworks in one process are usually one framework and its helpers: torch loads triton for
torch.compile, a JAX program imports TensorFlow for tf.data, numba-cuda builds on cuda-python; only the
framework that runs the work speaks (`leads`). Two that both do (a PyTorch process that runs CuPy
kernels, two programs of different frameworks on one GPU) each say their fix, named.

Every verdict kind and every trace rule has words for every framework, or falls back to the CUDA-level
words explicitly (tests/test_advice.py walks them all).

    >>> fixes("launch_bound", ("jax",))[0][:60]
    'Many small operations are dispatched one by one: compile the'
    >>> fixes("launch_bound", ())[0] == fixes("launch_bound", ("cuda",))[0]
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["FRAMEWORKS", "NAMES", "NEUTRAL", "RULES", "RULES_SAME_AS_CUDA", "SAME_AS_CUDA", "VERDICTS", "fixes",
           "frameworks_of", "leads", "rule_fix"]

#: The frameworks gpuscope._frameworks names, in the order their fixes are given; "cuda" is the CUDA-level
#: fix, also given where the framework is not known.
FRAMEWORKS = ("torch", "jax", "tensorflow", "cupy", "numba", "triton", "cuda-python", "cuda")
NAMES = {"torch": "PyTorch", "jax": "JAX", "tensorflow": "TensorFlow", "cupy": "CuPy", "numba": "Numba",
         "triton": "Triton", "cuda-python": "cuda-python", "cuda": "CUDA"}

# A framework that is only a helper of another in the same process: (helper, the frameworks it serves).
_HELPER_OF = {
    "triton": {"torch", "jax"},  # torch.compile's and Pallas' code generator
    "tensorflow": {"jax", "torch"},  # tf.data / TensorBoard beside the framework that trains
    "numba": {"torch", "jax", "tensorflow"},  # a CPU dependency (librosa, umap, pandas)
    "cuda-python": {"torch", "jax", "tensorflow", "cupy", "numba", "triton"},  # numba-cuda's and cupy's bindings
}

# -- metric verdicts -------------------------------------------------------------------------------------

#: Verdicts whose fix does not depend on the framework: the hardware, the clocks, a reservation.
_NEUTRAL = {
    "healthy": ["No bottleneck to fix: the SMs are busy and no single resource is saturated."],
    "idle_allocated": ["Memory is held but nothing runs: release the GPU (end the notebook kernel or job) or "
                       "give it to someone else; you pay for it idle."],
    "idle": ["The GPU is idle."],
    "underutilized": ["The SMs are mostly idle without one clear cause: check the input pipeline and "
                      "synchronisations with `gpuscope trace`."],
    "throttled": ["Clocks are cut by temperature or a hardware slowdown: check cooling, airflow and fan "
                  "state, the power supply, and `nvidia-smi -q -d PERFORMANCE`; the job runs slower than it could."],
    "power_capped": ["Clocks are held at the power limit: expected at full tensor load. A higher limit "
                     "(nvidia-smi -pl) or better perf/watt settings change it; nothing is wrong."],
    "hardware": ["Hardware errors: see the XID codes and ECC counters in the evidence; drain the GPU and "
                 "check it (nvidia-smi -q, dmesg) before it corrupts results."],
    "gpu_lost": ["The GPU fell off the bus: its processes are dead; it needs a reset (nvidia-smi -r) or a reboot."],
    "imbalance": ["One GPU does less than its peers: a straggler holds back every synchronised step. Check "
                  "its clocks and throttling, its data shard, and NCCL topology."],
}

#: The verdict kinds whose fix is the same for every framework.
NEUTRAL = frozenset(_NEUTRAL)

_CUDA_MEMORY_ACCESS = ("The SMs are busy but neither the math pipes nor DRAM are: kernels stall on memory "
                       "latency or poor access patterns. Profile the top kernels (gpuscope trace, ncu); "
                       "look for uncoalesced or strided access, small gathers/scatters, low occupancy.")

_TORCH = {
    "compute_bound": ["The tensor cores are the limit: that is where you want to be. To go faster: a larger "
                      "batch if memory allows, FP8 (Transformer Engine) where accuracy allows, or more GPUs."],
    "tensor_cores_unused": ["Matrix math runs on the CUDA cores, not the tensor cores: use bf16/fp16 autocast "
                            "(torch.autocast('cuda', dtype=torch.bfloat16)) or allow TF32 "
                            "(torch.backends.cuda.matmul.allow_tf32 = True; torch.set_float32_matmul_precision('high'))."],
    "memory_bound": ["DRAM bandwidth is the limit: fuse elementwise ops (torch.compile), keep activations in "
                     "bf16, avoid needless copies (.contiguous(), .clone()), and raise arithmetic intensity "
                     "(larger batches for matmuls)."],
    "memory_access_bound": [_CUDA_MEMORY_ACCESS],
    "transfer_bound": ["Host<->device copies dominate while the SMs idle: keep data on the GPU across steps, "
                       "use pinned memory (DataLoader(pin_memory=True), tensor.pin_memory()) and "
                       "non_blocking=True copies, overlap copies with compute on a side stream."],
    "launch_or_sync_bound": ["The GPU waits on the CPU: a Python thread at 100 % launches small kernels or "
                             "waits on synchronisations. Remove .item()/.cpu()/print of GPU tensors inside the "
                             "loop, batch small ops, capture the step with CUDA graphs "
                             "(torch.cuda.graphs / torch.compile(mode='reduce-overhead')); if the thread "
                             "prepares data, move that to DataLoader workers (num_workers > 0). "
                             "Stack sampling (py-spy, needs ptrace permission) or `gpuscope trace` tells which."],
    "input_starved": ["The GPU works in bursts and waits for data in between: more DataLoader workers "
                      "(num_workers), pin_memory=True, prefetch_factor, persistent_workers=True; move "
                      "decoding/augmentation to the GPU (DALI, torchvision.transforms.v2 on tensors)."],
    "launch_bound": ["The Python thread spends its time issuing many small GPU operations: fuse them "
                     "(torch.compile), batch small tensors into larger ones, and capture the step with CUDA graphs "
                     "(torch.compile(mode='reduce-overhead') or torch.cuda.graphs) to launch it at once."],
    "sync_bound": ["The host waits for the GPU, then the GPU waits for the host: remove .item()/.cpu()/"
                   ".tolist()/print of GPU tensors inside the loop (accumulate on the GPU, read once per N steps), "
                   "avoid torch.cuda.synchronize(), and use non_blocking=True copies."],
    "host_bound": ["The GPU waits while the host thread computes something else: move that work to the GPU, "
                   "to DataLoader workers or a background thread, or overlap it with GPU work."],
    "memory_growth": ["GPU memory grows steadily: look for tensors kept across steps (losses appended "
                      "without .item()/.detach(), growing caches, graphs kept alive by references)."],
}

_JAX = {
    "compute_bound": ["The tensor cores are the limit: that is where you want to be. To go faster: a larger "
                      "batch if memory allows, FP8 matmuls (jax.numpy.float8_e4m3fn, Transformer Engine for JAX) "
                      "where accuracy allows, or more GPUs (jax.sharding)."],
    "tensor_cores_unused": ["Matrix math runs on the CUDA cores, not the tensor cores: compute in bf16 "
                            "(params and activations as jax.numpy.bfloat16), or let float32 matmuls use TF32: "
                            "jax.default_matmul_precision('tensorfloat32'), or precision=jax.lax.Precision.DEFAULT "
                            "instead of HIGHEST on jnp.matmul / jnp.dot / jax.lax.dot_general."],
    "memory_bound": ["DRAM bandwidth is the limit: compile the whole step with jax.jit so XLA fuses the "
                     "elementwise ops, keep activations in jax.numpy.bfloat16, donate the buffers a step "
                     "replaces (jax.jit(step, donate_argnums=...)) instead of copying them, and raise "
                     "arithmetic intensity (larger batches for matmuls)."],
    "memory_access_bound": ["The SMs are busy but neither the math pipes nor DRAM are: kernels stall on memory "
                            "latency or poor access patterns. Profile the top kernels (gpuscope trace, "
                            "jax.profiler.trace, ncu); gathers and scatters from fancy indexing (x[idx], "
                            ".at[idx].set) and transposes are the usual cause: use contiguous slices "
                            "(jax.lax.dynamic_slice), or batch with jax.vmap."],
    "transfer_bound": ["Host<->device copies dominate while the SMs idle: put the data on the GPU once, ahead "
                       "of time (jax.device_put before the loop), keep it there across steps, donate updated "
                       "buffers (donate_argnums) instead of copying, and jax.device_put the next batch while the "
                       "current step runs (dispatch is asynchronous); a NumPy array passed to a jitted function "
                       "is copied on every call."],
    "launch_or_sync_bound": ["The GPU waits on the CPU: operations are dispatched one by one (no jax.jit) or "
                             "the host waits for results. Wrap the step in jax.jit so it runs as one XLA "
                             "program, loop with jax.lax.scan / jax.lax.fori_loop, read device values "
                             "(float(x), np.asarray(x), print) only every N steps, and call "
                             "jax.block_until_ready only at the end. Stack sampling (py-spy, needs ptrace "
                             "permission) or `gpuscope trace` tells which."],
    "input_starved": ["The GPU works in bursts and waits for data in between: prepare batches in parallel "
                      "(grain with worker_count > 0, or tf.data with .map(num_parallel_calls=tf.data.AUTOTUNE) "
                      "and .prefetch), and jax.device_put the next batch ahead of the step that needs it "
                      "(prefetch to the device); move decoding/augmentation into the jitted step."],
    "launch_bound": ["Many small operations are dispatched one by one: compile the step with jax.jit so XLA "
                     "fuses them into few kernels, replace Python loops over arrays with jax.lax.scan, "
                     "jax.lax.fori_loop or jax.vmap, and batch small arrays into larger ones."],
    "sync_bound": ["The host waits for the GPU, then the GPU waits for the host: remove host reads of device "
                   "arrays inside the loop (float(x), np.asarray(x), x.tolist(), jax.device_get, print of "
                   "arrays): keep metrics on the device and fetch them once per N steps; call "
                   "jax.block_until_ready only at the end (or to time a step)."],
    "host_bound": ["The GPU waits while the host thread computes something else: move that work into the "
                   "jitted step (jax.numpy on the device), to a background thread, or overlap it with device "
                   "work (dispatch is asynchronous: queue the next step before reading results)."],
    "memory_growth": ["GPU memory grows steadily: look for device arrays kept across steps (metrics appended "
                      "to a list, growing caches) and recompilations (each new input shape compiles and keeps "
                      "another program: keep shapes static, mark config arguments static_argnums)."],
}

_TENSORFLOW = {
    "compute_bound": ["The tensor cores are the limit: that is where you want to be. To go faster: a larger "
                      "batch if memory allows, the mixed_bfloat16 policy if it is not on yet, or more GPUs "
                      "(tf.distribute.MirroredStrategy / MultiWorkerMirroredStrategy)."],
    "tensor_cores_unused": ["Matrix math runs on the CUDA cores, not the tensor cores: set a mixed precision "
                            "policy (tf.keras.mixed_precision.set_global_policy('mixed_bfloat16'), or "
                            "'mixed_float16' with a LossScaleOptimizer) or allow TF32 "
                            "(tf.config.experimental.enable_tensor_float_32_execution(True))."],
    "memory_bound": ["DRAM bandwidth is the limit: compile the step with XLA (tf.function(jit_compile=True), "
                     "or model.compile(jit_compile=True)) so elementwise ops fuse, use the mixed_bfloat16 "
                     "policy to halve the bytes moved, and raise arithmetic intensity (larger batches)."],
    "memory_access_bound": ["The SMs are busy but neither the math pipes nor DRAM are: kernels stall on memory "
                            "latency or poor access patterns. Profile the top kernels (gpuscope trace, the "
                            "TensorBoard profiler, ncu); tf.gather / tf.scatter_nd and transposes are the usual "
                            "cause; XLA (tf.function(jit_compile=True)) often fuses them away."],
    "transfer_bound": ["Host<->device copies dominate while the SMs idle: keep tensors on the GPU across steps, "
                       "feed through tf.data with .prefetch(tf.data.AUTOTUNE) (and "
                       "tf.data.experimental.prefetch_to_device('/gpu:0')), and do not turn tensors into NumPy "
                       "arrays (.numpy()) and back every step."],
    "launch_or_sync_bound": ["The GPU waits on the CPU: eager execution runs op by op, or the host reads "
                             "results every step. Run the step as a graph (tf.function, jit_compile=True for "
                             "XLA fusion; in Keras model.compile(jit_compile=True, steps_per_execution=N)), "
                             "drop .numpy()/print of tensors from the loop, and feed with tf.data and "
                             ".prefetch. Stack sampling (py-spy, needs ptrace permission) or `gpuscope trace` "
                             "tells which."],
    "input_starved": ["The GPU works in bursts and waits for data in between: parallelise the input pipeline "
                      "(tf.data .map(num_parallel_calls=tf.data.AUTOTUNE), .interleave for file reads, .cache, "
                      ".prefetch(tf.data.AUTOTUNE)) and move decoding/augmentation onto the GPU (Keras "
                      "preprocessing layers inside the model)."],
    "launch_bound": ["The Python thread spends its time issuing many small GPU operations: compile the step "
                     "(tf.function(jit_compile=True)) so XLA fuses them, vectorise Python loops "
                     "(tf.vectorized_map), batch small tensors, and in Keras run several steps per call "
                     "(model.compile(steps_per_execution=N))."],
    "sync_bound": ["The host waits for the GPU, then the GPU waits for the host: remove .numpy(), float(t) and "
                   "print of tensors inside the loop; keep metrics in tf.Variables or Keras metrics on the "
                   "device and read them once per N steps."],
    "host_bound": ["The GPU waits while the host thread computes something else: move that work into the "
                   "tf.data pipeline (parallel .map), into the tf.function graph, or to a background thread."],
    "memory_growth": ["GPU memory grows steadily: look for tensors kept across steps (Python lists of tensors, "
                      "growing variables) and retracing (a tf.function traced again for each new shape or Python "
                      "argument keeps another graph: give it an input_signature or reduce_retracing=True)."],
}

_CUPY = {
    "compute_bound": ["The tensor cores are the limit: that is where you want to be. To go faster: larger "
                      "matrices per call (batched cupy.matmul), float16 where accuracy allows, or more GPUs."],
    "tensor_cores_unused": ["Matrix math runs on the CUDA cores, not the tensor cores: multiply float16 arrays "
                            "(a.astype(cupy.float16)), or let cuBLAS use TF32 for float32 (CUPY_TF32=1 in the "
                            "environment); in your own RawKernel, use WMMA (mma.h) fragments."],
    "memory_bound": ["DRAM bandwidth is the limit: each CuPy array operation reads and writes whole arrays, so "
                     "fuse chains of them into one kernel (@cupy.fuse, cupy.ElementwiseKernel, "
                     "cupy.ReductionKernel), use float32/float16 instead of float64 where accuracy allows, and "
                     "avoid temporaries (out= arguments, in-place operators)."],
    "memory_access_bound": ["The SMs are busy but neither the math pipes nor DRAM are: kernels stall on memory "
                            "latency or poor access patterns. In your own ElementwiseKernel / RawKernel, let "
                            "consecutive threads touch consecutive addresses, stage reused data in shared "
                            "memory, and make strided views contiguous first (cupy.ascontiguousarray); "
                            "`gpuscope trace` or ncu names the kernels."],
    "transfer_bound": ["Host<->device copies dominate while the SMs idle: keep arrays on the GPU across steps "
                       "(cupy.asarray once, cupy.asnumpy only at the end), copy from pinned host memory "
                       "(cupyx.empty_pinned, the pinned memory pool through cupy.cuda.alloc_pinned_memory) and "
                       "asynchronously on a non-blocking stream (cupy.cuda.Stream(non_blocking=True), "
                       "arr.set(host, stream=s)), overlapping copies with kernels on another stream."],
    "launch_or_sync_bound": ["The GPU waits on the CPU: a Python thread at 100 % launches small kernels or "
                             "waits on synchronisations. Fuse operations (@cupy.fuse, ElementwiseKernel, "
                             "RawKernel), capture the loop body as a CUDA graph (stream.begin_capture() ... "
                             "stream.end_capture() gives a cupy.cuda.Graph, then graph.launch()), and take "
                             "cupy.asnumpy / .get() / float(x) / Device().synchronize() out of the loop. Stack "
                             "sampling (py-spy, needs ptrace permission) or `gpuscope trace` tells which."],
    "input_starved": ["The GPU works in bursts and waits for data in between: prepare the next batch on "
                      "background threads or processes into pinned buffers (cupyx.empty_pinned), copy it on a "
                      "side stream (cupy.cuda.Stream(non_blocking=True)) while the current one computes (double "
                      "buffering), and move decoding to the GPU (nvImageCodec, DALI)."],
    "launch_bound": ["The Python thread spends its time issuing many small GPU operations: fuse them (@cupy.fuse "
                     "for elementwise chains, cupy.ElementwiseKernel / ReductionKernel / RawKernel for the "
                     "rest), batch small arrays into larger ones, and capture the step as a CUDA graph "
                     "(cupy.cuda.Stream.begin_capture / end_capture, then cupy.cuda.Graph.launch) to launch it "
                     "at once."],
    "sync_bound": ["The host waits for the GPU, then the GPU waits for the host: remove device-to-host reads "
                   "inside the loop (cupy.asnumpy, .get(), float(x), print of arrays) and explicit waits "
                   "(cupy.cuda.Device().synchronize(), Stream.synchronize()): accumulate on the GPU, read once "
                   "per N steps, and order streams with events (cupy.cuda.Event, stream.wait_event)."],
    "host_bound": ["The GPU waits while the host thread computes something else: move that work onto the GPU "
                   "(CuPy array operations, cupyx.scipy), to a background thread, or overlap it with GPU work "
                   "(CuPy launches are asynchronous: queue the next work before reading results)."],
    "memory_growth": ["GPU memory grows steadily: look for arrays kept across steps (lists of arrays, growing "
                      "caches). CuPy's memory pool keeps freed blocks for reuse, which is not a leak: "
                      "cupy.get_default_memory_pool().used_bytes() against total_bytes() tells which, and "
                      "free_all_blocks() returns the cache."],
}

_NUMBA = {
    "tensor_cores_unused": ["Matrix math runs on the CUDA cores, not the tensor cores: a @cuda.jit kernel cannot "
                            "reach them; hand the matrix products to cuBLAS (through CuPy on the same device "
                            "arrays, zero-copy by __cuda_array_interface__) in float16 or with TF32."],
    "memory_bound": ["DRAM bandwidth is the limit: merge kernels that pass arrays through DRAM into one "
                     "@cuda.jit kernel, keep intermediates in registers or cuda.shared.array, and use float32 "
                     "(a Python float literal makes the arithmetic float64: write numba.float32 constants)."],
    "memory_access_bound": ["The SMs are busy but neither the math pipes nor DRAM are: kernels stall on memory "
                            "latency or poor access patterns. Index with cuda.grid(1) so consecutive threads "
                            "touch consecutive elements, stage reused data in cuda.shared.array (with "
                            "cuda.syncthreads()), and avoid strided or transposed device arrays."],
    "transfer_bound": ["Host<->device copies dominate while the SMs idle: copy to the device once "
                       "(cuda.to_device) and keep the device arrays across launches (a NumPy array passed to a "
                       "kernel is copied in and out on every launch); use pinned host memory (cuda.pinned_array, "
                       "or with cuda.pinned(arr)) and asynchronous copies on a stream (s = cuda.stream(); "
                       "cuda.to_device(a, stream=s); d.copy_to_host(stream=s))."],
    "launch_or_sync_bound": ["The GPU waits on the CPU: fewer kernel launches (one grid over all the work, a "
                             "loop inside the kernel), device arrays from cuda.to_device instead of NumPy "
                             "arrays (each launch with those copies and synchronises), launches on a stream "
                             "(kernel[blocks, threads, stream]) and one stream.synchronize() at the end. Stack "
                             "sampling (py-spy, needs ptrace permission) or `gpuscope trace` tells which."],
    "input_starved": ["The GPU works in bursts and waits for data in between: prepare batches on background "
                      "threads or processes into pinned buffers (cuda.pinned_array), and copy each one on its "
                      "own stream (cuda.stream(), cuda.to_device(batch, stream=s)) while the previous one "
                      "computes (double buffering)."],
    "launch_bound": ["The Python thread spends its time issuing many small GPU operations: fewer kernel "
                     "launches (merge @cuda.jit kernels, give each launch a large grid with a grid-stride loop "
                     "over cuda.gridsize(1)), batch small arrays, and compile ahead (an explicit signature, or "
                     "cache=True) so that no launch in the loop compiles."],
    "sync_bound": ["The host waits for the GPU, then the GPU waits for the host: remove copy_to_host(), "
                   "cuda.synchronize() and NumPy-array kernel arguments inside the loop: keep results in device "
                   "arrays, copy them back once at the end (or every N steps), and launch on streams so that "
                   "launches queue instead of waiting."],
    "host_bound": ["The GPU waits while the host thread computes something else: move that work into a "
                   "@cuda.jit kernel, into @numba.njit(parallel=True) on other threads, or overlap it with GPU "
                   "work launched on a stream."],
    "memory_growth": ["GPU memory grows steadily: look for device arrays kept across iterations (lists of "
                      "device arrays) and allocations inside the loop (cuda.device_array each step): allocate "
                      "once and reuse the arrays."],
}

_TRITON = {
    "tensor_cores_unused": ["Matrix math runs on the CUDA cores, not the tensor cores: compute tile products "
                            "with tl.dot on fp16/bf16 blocks (tl.dot runs on the tensor cores; for float32 "
                            "inputs input_precision='tf32'), not with elementwise multiplies and tl.sum."],
    "memory_bound": ["DRAM bandwidth is the limit: fuse the work into the Triton kernel that produces the data "
                     "(one load and one store per element), store in bf16/fp16, and let @triton.autotune pick "
                     "BLOCK_SIZE, num_warps and num_stages from a few configs."],
    "memory_access_bound": ["The SMs are busy but neither the math pipes nor DRAM are: kernels stall on memory "
                            "latency or poor access patterns. Load contiguous blocks (tl.arange along the "
                            "contiguous axis, tl.max_contiguous / tl.multiple_of hints), use block pointers "
                            "(tl.make_block_ptr) for 2-D tiles, and autotune num_stages for pipelining."],
    "launch_bound": ["The Python thread spends its time issuing many small GPU operations: give each Triton "
                     "program more work (a larger BLOCK_SIZE, autotuned: @triton.autotune with configs over "
                     "BLOCK_SIZE and num_warps), fuse consecutive kernels into one @triton.jit kernel, and "
                     "keep constexpr arguments and dtypes stable so that no call recompiles."],
}

#: The CUDA-level fix: for CUDA C++ programs, cuda-python, and any framework not known.
_CUDA = {
    "compute_bound": ["The tensor cores are the limit: that is where you want to be. To go faster: a larger "
                      "batch or problem if memory allows, FP8 matmuls (cuBLASLt) where accuracy allows, or "
                      "more GPUs."],
    "tensor_cores_unused": ["Matrix math runs on the CUDA cores, not the tensor cores: call cuBLAS / cuBLASLt "
                            "(cublasGemmEx, cublasLtMatmul) with FP16/BF16 inputs or a TF32 compute type "
                            "(CUBLAS_COMPUTE_32F_FAST_TF32, or cublasSetMathMode(handle, "
                            "CUBLAS_TF32_TENSOR_OP_MATH)); in your own kernels use WMMA / mma.sync (or CUTLASS)."],
    "memory_bound": ["DRAM bandwidth is the limit: fuse kernels that pass data through DRAM into one, use "
                     "narrower types (FP16/BF16), vectorised loads (float4), and raise arithmetic intensity "
                     "(tiling in shared memory, larger batches)."],
    "memory_access_bound": [_CUDA_MEMORY_ACCESS],
    "transfer_bound": ["Host<->device copies dominate while the SMs idle: keep data on the GPU across steps, "
                       "allocate host buffers pinned (cudaMallocHost / cudaHostAlloc, or cudaHostRegister), copy "
                       "with cudaMemcpyAsync on a non-default stream and overlap copies with kernels on another "
                       "stream."],
    "launch_or_sync_bound": ["The GPU waits on the CPU: a host thread at 100 % launches small kernels or waits "
                             "on synchronisations. Launch fewer, bigger kernels (fuse, batch), replay a repeated "
                             "sequence as a CUDA graph (cudaStreamBeginCapture, cudaGraphInstantiate, "
                             "cudaGraphLaunch), and take cudaDeviceSynchronize / synchronous cudaMemcpy out of "
                             "the loop (cudaMemcpyAsync, one wait where the result is needed). Stack sampling or "
                             "`gpuscope trace` tells which."],
    "input_starved": ["The GPU works in bursts and waits for data in between: produce batches on other threads "
                      "into pinned buffers, copy them with cudaMemcpyAsync on a second stream while the current "
                      "batch computes (double buffering), and decode on the GPU (nvJPEG, DALI)."],
    "launch_bound": ["The host spends its time issuing many small GPU operations: fuse small kernels, give each "
                     "launch more work (grid-stride loops, batching), and replay the repeated sequence as a CUDA "
                     "graph (stream capture, then cudaGraphLaunch) to launch it at once."],
    "sync_bound": ["The host waits for the GPU, then the GPU waits for the host: take cudaDeviceSynchronize, "
                   "cudaStreamSynchronize and synchronous cudaMemcpy out of the loop, order streams with events "
                   "(cudaEventRecord, cudaStreamWaitEvent), and read results back once per N steps."],
    "host_bound": ["The GPU waits while the host thread computes something else: move that work to the GPU, "
                   "to another thread, or overlap it with GPU work (launches are asynchronous: queue the next "
                   "work before the host computes)."],
    "memory_growth": ["GPU memory grows steadily: look for cudaMalloc without its cudaFree, allocations in every "
                      "step (allocate once, or use the stream-ordered pool: cudaMallocAsync / cudaFreeAsync), "
                      "and buffers kept across steps."],
}

# Where a framework's own words would be the CUDA-level ones, it says so here (tests check every kind has
# words or is listed): Numba has no tensor-core path of its own to be compute-bound on; Triton programs
# take their data, copies and syncs from PyTorch or JAX; cuda-python is the CUDA API itself.
SAME_AS_CUDA = {
    "numba": {"compute_bound"},
    "triton": {"compute_bound", "transfer_bound", "launch_or_sync_bound", "input_starved", "sync_bound",
               "host_bound", "memory_growth"},
    "cuda-python": set(_CUDA),
}

#: Per framework, verdict kind -> its fixes ("cuda": the CUDA-level fix).
VERDICTS: dict[str, dict[str, list[str]]] = {
    name: {**_NEUTRAL, **{k: _CUDA[k] for k in SAME_AS_CUDA.get(name, ())}, **own}
    for name, own in (("torch", _TORCH), ("jax", _JAX), ("tensorflow", _TENSORFLOW), ("cupy", _CUPY),
                      ("numba", _NUMBA), ("triton", _TRITON), ("cuda-python", {}), ("cuda", _CUDA))
}

# -- trace findings (trace.rules): one fix each ---------------------------------------------------------

_COMPLEX = ("Complex matrix math{at} has no TF32/bf16 tensor-core path: split it into real products (real and "
            "imaginary parts as float32 matmuls with TF32 allowed) if its time matters.")
_GEMV = ("Matrix-vector products{at} cannot use the tensor cores and are limited by memory bandwidth: batch the "
         "vectors into one matrix (one matmul for many inputs), or keep the matrix in bf16 to halve the bytes read.")
_SYNC_TAIL = "each sync drains the GPU's queue, so the GPU waits while the host prepares the next work."

_TORCH_RULES = {
    "pageable_memcpy": "Copy from pinned memory: DataLoader(..., pin_memory=True), or keep a host buffer allocated "
                       "with torch.empty(..., pin_memory=True) / tensor.pin_memory() and copy with "
                       ".to(device, non_blocking=True); pageable copies go through a CPU staging copy at a "
                       "fraction of the PCIe bandwidth and block the host.",
    "sync_memcpy": "Use asynchronous copies from pinned memory: tensor.to(device, non_blocking=True) from a pinned "
                   "tensor (cudaMemcpyAsync in C++), and synchronise once where the result is needed.",
    "sync_memset": "Use the asynchronous form on a stream (torch.zeros(..., device=...) / tensor.zero_() in "
                   "PyTorch, cudaMemsetAsync in C++) so the host does not wait for it.",
    "sync_in_loop": "Move the {call} out of the loop at {where}: accumulate on the GPU (e.g. total += "
                    "loss.detach()) and read the value once after the loop or every N steps; " + _SYNC_TAIL,
    "gpu_gaps": "Find what the host does in the largest gaps (above) and overlap it with GPU work: move data "
                "loading to DataLoader workers (num_workers, pin_memory, prefetch), take syncs (.item(), .cpu()) "
                "out of the step, and batch small launches (torch.compile, CUDA graphs) so the GPU always has "
                "work queued.",
    "tiny_kernel_storm": "Launch fewer, bigger kernels: torch.compile(model) fuses the elementwise chains; "
                         "torch.compile(mode=\"reduce-overhead\") or torch.cuda.graphs (CUDAGraph / "
                         "make_graphed_callables) replays the whole step in one launch; a bigger batch gives each "
                         "kernel more work.",
    "low_occupancy.grid": "Give the kernel more parallel work: a bigger batch, fusing small ops (torch.compile), or "
                          "for matmuls TF32/bf16 (torch.backends.cuda.matmul.allow_tf32 = True, autocast) so "
                          "cuBLAS picks a kernel with more tiles.",
    "low_occupancy.registers": "Register pressure limits resident warps: for your own Triton/CUDA kernels use "
                               "smaller tiles or fewer warps (num_warps), __launch_bounds__ / maxrregcount; for "
                               "library kernels try torch.compile(mode=\"max-autotune\") to pick another variant.",
    "low_occupancy.shared": "Shared memory per block limits resident blocks: use smaller tiles or fewer pipeline "
                            "stages (num_stages in Triton), or let torch.compile(mode=\"max-autotune\") choose.",
    "low_occupancy.threads": "Block size limits resident blocks: use blocks of 128-256 threads.",
    "tensor_cores_unused.fp32": "Let the tensor cores do the matrix math{at}: torch.set_float32_matmul_precision("
                                "'high') (or torch.backends.cuda.matmul.allow_tf32 = True) runs FP32 matmuls as TF32 "
                                "on them, about 8x the FP32 rate; torch.autocast('cuda', dtype=torch.bfloat16) around "
                                "the step (or bf16 weights and inputs) is faster still; convolutions need "
                                "torch.backends.cudnn.allow_tf32 = True (PyTorch's default) and gain from "
                                "channels_last.",
    "tensor_cores_unused.fp16": "Half-precision matrix math on the CUDA cores{at}: usually a shape the tensor-core "
                                "kernels cannot take; pad the matrix dimensions to multiples of 8 (16 for int8/fp8) "
                                "and keep tensors contiguous.",
    "tensor_cores_unused.fp64": "Double-precision matrix math{at} runs at a small fraction of the tensor cores' "
                                "FP32/bf16 rates: if the result does not need FP64, compute in float32 with TF32 "
                                "(torch.set_float32_matmul_precision('high')) or in bf16 (torch.autocast).",
    "tensor_cores_unused.complex": _COMPLEX,
    "tensor_cores_unused.gemv": _GEMV,
    "elementwise_heavy": "Make fewer passes over memory: torch.compile fuses a chain of elementwise ops and reductions into "
                         "one kernel that reads and writes each tensor once; write in place (x.mul_(...)) or into out= "
                         "buffers, and keep activations in bf16 (half the bytes).",
}

_JAX_RULES = {
    "pageable_memcpy": "Copies from pageable host memory go through a CPU staging copy at a fraction of the PCIe "
                       "bandwidth: put the data on the device once (jax.device_put before the loop) and keep it "
                       "there; for streaming input, jax.device_put the next batch before running the current step "
                       "(copies and dispatch are asynchronous), or stage it in pinned host memory "
                       "(memory_kind='pinned_host' shardings).",
    "sync_memcpy": "Avoid blocking device-to-host reads (np.asarray(x), jax.device_get(x), float(x)) in the step: "
                   "start the copy early with x.copy_to_host_async() and read once, where the value is needed.",
    "sync_memset": "Create constants inside the jitted function (jnp.zeros in the jax.jit step) so XLA fills "
                   "them on the device, asynchronously, instead of between steps.",
    "sync_in_loop": "Move the {call} out of the loop at {where}: keep the values on the device (accumulate in "
                    "a jax array inside the jitted step), read them once after the loop or every N steps, and "
                    "call jax.block_until_ready only at the end; " + _SYNC_TAIL,
    "gpu_gaps": "Find what the host does in the largest gaps (above) and overlap it with GPU work: compile the "
                "step with jax.jit, jax.device_put the next batch ahead of time, take host reads (float(x), "
                "np.asarray) out of the step, and call jax.block_until_ready only at the end, so the GPU "
                "always has work queued.",
    "tiny_kernel_storm": "Launch fewer, bigger kernels: jax.jit the step so XLA fuses the small operations, use "
                         "jax.lax.scan / jax.lax.fori_loop / jax.vmap instead of Python loops over small arrays; "
                         "a bigger batch gives each kernel more work.",
    "low_occupancy.grid": "Give the kernel more parallel work: a bigger batch, jax.vmap over examples, fusion "
                          "under jax.jit, or for matmuls bf16 / jax.default_matmul_precision('tensorfloat32') "
                          "so cuBLAS picks a kernel with more tiles.",
    "low_occupancy.registers": "Register pressure limits resident warps: XLA chose this kernel (another batch "
                               "shape or dtype gives another); for your own Pallas or Triton kernels use smaller "
                               "blocks or fewer warps (num_warps).",
    "low_occupancy.shared": "Shared memory per block limits resident blocks: for your own Pallas or Triton "
                            "kernels use smaller blocks or fewer pipeline stages (num_stages).",
    "tensor_cores_unused.fp32": "Let the tensor cores do the matrix math{at}: "
                                "jax.default_matmul_precision('tensorfloat32') (or precision=jax.lax.Precision.DEFAULT "
                                "instead of HIGHEST) runs float32 matmuls and convolutions as TF32 on them, about 8x "
                                "the FP32 rate; bf16 params and inputs (jax.numpy.bfloat16) are faster still.",
    "tensor_cores_unused.fp64": "Double-precision matrix math{at} runs at a small fraction of the tensor cores' "
                                "FP32/bf16 rates: if the result does not need FP64, turn jax_enable_x64 off (or make "
                                "the arrays float32) and allow TF32 (jax.default_matmul_precision('tensorfloat32')), "
                                "or compute in jax.numpy.bfloat16.",
    "elementwise_heavy": "Make fewer passes over memory: inside jax.jit, XLA fuses a chain of elementwise ops and reductions "
                         "into one kernel; donate_argnums lets it write in place, and bf16 arrays halve the bytes.",
}

_TENSORFLOW_RULES = {
    "pageable_memcpy": "Copies from pageable host memory go through a CPU staging copy at a fraction of the PCIe "
                       "bandwidth: feed through tf.data with .prefetch(tf.data.AUTOTUNE) and "
                       "tf.data.experimental.prefetch_to_device('/gpu:0') instead of NumPy arrays each step, and "
                       "keep tensors on the GPU between steps.",
    "sync_memcpy": "Avoid blocking device-to-host reads (.numpy(), float(t)) in the step: keep results as tensors "
                   "on the device and read them once, where the value is needed.",
    "sync_memset": "Create constants inside the tf.function (tf.zeros in the compiled step) so they are filled on "
                   "the device, asynchronously, instead of between steps.",
    "sync_in_loop": "Move the {call} out of the loop at {where}: keep metrics in tf.Variables or Keras metrics "
                    "on the device and read them (.numpy()) once after the loop or every N steps; " + _SYNC_TAIL,
    "gpu_gaps": "Find what the host does in the largest gaps (above) and overlap it with GPU work: run the step "
                "as a graph (tf.function(jit_compile=True)), feed it with tf.data (.map(num_parallel_calls="
                "tf.data.AUTOTUNE), .prefetch), and take .numpy() reads out of the step, so the GPU always has "
                "work queued.",
    "tiny_kernel_storm": "Launch fewer, bigger kernels: tf.function(jit_compile=True) fuses the small operations, "
                         "tf.vectorized_map replaces Python loops, Keras' steps_per_execution=N runs several "
                         "steps per call; a bigger batch gives each kernel more work.",
    "low_occupancy.grid": "Give the kernel more parallel work: a bigger batch, XLA fusion "
                          "(tf.function(jit_compile=True)), or for matmuls the mixed_bfloat16 policy or TF32 so "
                          "cuBLAS picks a kernel with more tiles.",
    "tensor_cores_unused.fp32": "Let the tensor cores do the matrix math{at}: "
                                "tf.config.experimental.enable_tensor_float_32_execution(True) (TensorFlow's default, "
                                "unless turned off) runs float32 matmuls and convolutions as TF32 on them, about 8x the "
                                "FP32 rate; the mixed_bfloat16 policy "
                                "(tf.keras.mixed_precision.set_global_policy('mixed_bfloat16')) is faster still.",
    "tensor_cores_unused.fp64": "Double-precision matrix math{at} runs at a small fraction of the tensor cores' "
                                "FP32/bf16 rates: if the result does not need FP64, use float32 tensors (with TF32 "
                                "allowed) or the mixed_bfloat16 policy.",
    "elementwise_heavy": "Make fewer passes over memory: tf.function(jit_compile=True) lets XLA fuse a chain of elementwise "
                         "ops and reductions into one kernel; mixed precision (mixed_bfloat16) halves the bytes.",
}

_CUPY_RULES = {
    "pageable_memcpy": "Copy from pinned memory: allocate the host buffer pinned (cupyx.empty_pinned / "
                       "cupyx.zeros_pinned, or from the pinned memory pool through cupy.cuda.alloc_pinned_memory) "
                       "and copy asynchronously on a non-blocking stream (arr.set(host, stream=s)); pageable "
                       "copies go through a CPU staging copy at a fraction of the PCIe bandwidth and block the "
                       "host.",
    "sync_memcpy": "Use asynchronous copies from pinned memory: arr.set(pinned_host, stream=s) and "
                   "arr.get(stream=s, out=pinned_host) on a cupy.cuda.Stream(non_blocking=True), and synchronise "
                   "once (s.synchronize()) where the result is needed.",
    "sync_memset": "Fill on a stream (arr.fill(0) or cupy.zeros under `with cupy.cuda.Stream(non_blocking=True):`) "
                   "so the host does not wait for it, and reuse the array instead of allocating a new one each "
                   "step.",
    "sync_in_loop": "Move the {call} out of the loop at {where}: accumulate on the GPU (total += x.sum() keeps "
                    "a 0-d CuPy array on the device) and read it once after the loop or every N steps "
                    "(cupy.asnumpy / .get()); order streams with events (cupy.cuda.Event, stream.wait_event) "
                    "instead of Device().synchronize(); " + _SYNC_TAIL,
    "gpu_gaps": "Find what the host does in the largest gaps (above) and overlap it with GPU work: prepare input "
                "on background threads into pinned buffers (cupyx.empty_pinned) copied on a side stream, take "
                "cupy.asnumpy / .get() / synchronize out of the step, fuse small kernels (@cupy.fuse, "
                "ElementwiseKernel) and capture the step as a CUDA graph (cupy.cuda.Graph), so the GPU always "
                "has work queued.",
    "tiny_kernel_storm": "Launch fewer, bigger kernels: @cupy.fuse or cupy.ElementwiseKernel / RawKernel turn a "
                         "chain of array operations into one kernel; capture the step as a CUDA graph "
                         "(stream.begin_capture() ... stream.end_capture() gives a cupy.cuda.Graph; "
                         "graph.launch() replays it in one launch); a bigger array gives each kernel more work.",
    "low_occupancy.grid": "Give the kernel more parallel work: bigger arrays per call (batch small ones), and for "
                          "your own RawKernel a grid that covers every element (at least a few blocks per SM); "
                          "for matmuls float16 or CUPY_TF32=1 so cuBLAS picks a kernel with more tiles.",
    "low_occupancy.registers": "Register pressure limits resident warps: in your RawKernel source use "
                               "__launch_bounds__ or compile with options=('--maxrregcount=64',), or split the "
                               "kernel; library kernels (cuBLAS) choose their own.",
    "low_occupancy.shared": "Shared memory per block limits resident blocks: use smaller tiles in your RawKernel "
                            "(less __shared__ memory per block), or smaller blocks.",
    "low_occupancy.threads": "Block size limits resident blocks: launch your RawKernel with block=(128,) to "
                             "(256,) threads.",
    "tensor_cores_unused.fp32": "Let the tensor cores do the matrix math{at}: CUPY_TF32=1 in the environment lets "
                                "cuBLAS run float32 matmuls as TF32 on them, about 8x the FP32 rate; float16 arrays "
                                "(a.astype(cupy.float16)) use them too.",
    "tensor_cores_unused.fp64": "Double-precision matrix math{at} runs at a small fraction of the tensor cores' "
                                "rates, and CuPy arrays are float64 unless told (cupy.random.rand, arrays from NumPy "
                                "floats): if the result does not need FP64, create them as float32 "
                                "(dtype=cupy.float32) with CUPY_TF32=1, or as float16.",
    "tensor_cores_unused.gemv": "Matrix-vector products{at} cannot use the tensor cores and are limited by memory "
                                "bandwidth: batch the vectors into one matrix (one cupy.matmul for many inputs), or "
                                "keep the matrix in float16 to halve the bytes read.",
    "elementwise_heavy": "Make fewer passes over memory: cupy.fuse() or one cupy.ElementwiseKernel / ReductionKernel does the "
                         "whole chain in one kernel that reads and writes each array once; pass out= to write in place, and "
                         "float16 arrays halve the bytes.",
}

_NUMBA_RULES = {
    "pageable_memcpy": "Copy from pinned memory: allocate host arrays with cuda.pinned_array (or wrap one in "
                       "`with cuda.pinned(arr):`) and copy on a stream (cuda.to_device(arr, stream=s)); pageable "
                       "copies go through a CPU staging copy at a fraction of the PCIe bandwidth and block the "
                       "host.",
    "sync_memcpy": "Use asynchronous copies from pinned memory on a stream: cuda.to_device(a, stream=s) and "
                   "d.copy_to_host(pinned, stream=s), and one s.synchronize() where the result is needed; pass "
                   "device arrays to kernels, not NumPy arrays (those copy in and out on every launch).",
    "sync_memset": "Allocate the device arrays once and zero them on a stream (a small @cuda.jit kernel launched "
                   "on it), not with a fresh zeroed copy each step.",
    "sync_in_loop": "Move the {call} out of the loop at {where}: keep results in device arrays, copy them back "
                    "once after the loop or every N steps (copy_to_host), drop cuda.synchronize() from the loop, "
                    "and pass device arrays to kernels, not NumPy arrays (each such launch copies back and "
                    "synchronises); " + _SYNC_TAIL,
    "gpu_gaps": "Find what the host does in the largest gaps (above) and overlap it with GPU work: copy to the "
                "device once (cuda.to_device), stage input in pinned arrays (cuda.pinned_array) copied on a "
                "stream, launch fewer, bigger kernels on streams, and synchronise once at the end, so the GPU "
                "always has work queued.",
    "tiny_kernel_storm": "Launch fewer, bigger kernels: merge small @cuda.jit kernels, give each launch a grid "
                         "that covers all the work (a grid-stride loop over cuda.gridsize(1)), batch small "
                         "arrays, and pass device arrays (cuda.to_device once) so that launches do not copy.",
    "low_occupancy.grid": "Give the kernel more parallel work: a grid that covers every element (cuda.grid(1) "
                          "indexing, at least a few blocks per SM), and bigger arrays per launch.",
    "low_occupancy.registers": "Register pressure limits resident warps: cap registers (@cuda.jit(max_registers=64)), "
                               "or split the kernel into simpler ones.",
    "low_occupancy.shared": "Shared memory per block limits resident blocks: make the cuda.shared.array tiles "
                            "smaller, or use smaller blocks.",
    "low_occupancy.threads": "Block size limits resident blocks: launch with 128-256 threads per block "
                             "(kernel[blocks, 256]).",
    "tensor_cores_unused.fp32": "A @cuda.jit kernel cannot use the tensor cores{at}: hand the matrix products to "
                                "cuBLAS (cupy.matmul on the same device arrays, zero-copy through "
                                "__cuda_array_interface__) with TF32 allowed (CUPY_TF32=1) or in float16.",
    "tensor_cores_unused.fp64": "Double-precision math{at} runs at a small fraction of the tensor cores' rates, "
                                "and Numba computes in float64 wherever a float64 array or a Python float literal "
                                "enters: use float32 arrays and numba.float32 constants if the result does not "
                                "need FP64.",
    "elementwise_heavy": "Make fewer passes over memory: do the whole chain of element operations in one @cuda.jit kernel "
                         "(each element read and written once) instead of one kernel per operation, and write in place.",
}

_TRITON_RULES = {
    "tiny_kernel_storm": "Launch fewer, bigger kernels: give each Triton program more work (a larger BLOCK_SIZE: "
                         "fewer programs, more work each), fuse consecutive kernels into one @triton.jit kernel, "
                         "autotune the configs (@triton.autotune over BLOCK_SIZE and num_warps), and replay the "
                         "sequence as a CUDA graph.",
    "low_occupancy.grid": "Give the kernel more programs: a smaller BLOCK_SIZE for small inputs, or split-K for "
                          "tall-skinny matmuls, chosen by @triton.autotune (key= the input sizes).",
    "low_occupancy.registers": "Register pressure limits resident warps: smaller tiles or fewer warps; autotune "
                               "the configs (@triton.autotune over BLOCK_SIZE, num_warps, num_stages).",
    "low_occupancy.shared": "Shared memory per block limits resident blocks: fewer pipeline stages (num_stages) "
                            "or smaller tiles, autotuned (@triton.autotune).",
    "low_occupancy.threads": "Block size limits resident blocks: try num_warps=4 or 8 in the autotune configs.",
    "tensor_cores_unused.fp32": "Let the tensor cores do the matrix math{at}: in your Triton kernels compute tile "
                                "products with tl.dot (input_precision='tf32' for float32 inputs, or bf16/fp16 "
                                "tiles), not with elementwise multiplies and tl.sum; library kernels take the CUDA "
                                "fix: a TF32 compute type in cuBLAS.",
    "elementwise_heavy": "Make fewer passes over memory: fuse the chain of element operations and the reduction into one "
                         "Triton kernel (each block loads its tile once), and store in bf16 to halve the bytes.",
}

_CUDA_RULES = {
    "pageable_memcpy": "Copy from pinned memory: allocate the host buffer with cudaMallocHost / cudaHostAlloc (or "
                       "cudaHostRegister an existing one) and copy with cudaMemcpyAsync on a stream; pageable "
                       "copies go through a CPU staging copy at a fraction of the PCIe bandwidth and block the "
                       "host.",
    "sync_memcpy": "Use asynchronous copies from pinned memory: cudaMemcpyAsync on a stream from a cudaMallocHost "
                   "buffer, and synchronise once (cudaStreamSynchronize or an event) where the result is needed.",
    "sync_memset": "Use cudaMemsetAsync on a stream so the host does not wait for it.",
    "sync_in_loop": "Move the {call} out of the loop at {where}: queue the work on streams, read results back "
                    "once after the loop or every N steps, and order streams with events (cudaEventRecord, "
                    "cudaStreamWaitEvent) instead of waiting on the host; " + _SYNC_TAIL,
    "gpu_gaps": "Find what the host does in the largest gaps (above) and overlap it with GPU work: prepare input "
                "on other threads into pinned buffers copied with cudaMemcpyAsync on a second stream, take "
                "synchronisations out of the loop, and batch small launches (fusion, CUDA graphs) so the GPU "
                "always has work queued.",
    "tiny_kernel_storm": "Launch fewer, bigger kernels: fuse small kernels, give each launch more work "
                         "(grid-stride loops, batching), and replay the repeated sequence as a CUDA graph "
                         "(cudaStreamBeginCapture, cudaGraphInstantiate, cudaGraphLaunch) in one launch.",
    "low_occupancy.grid": "Give the kernel more parallel work: at least two blocks per SM (split the work, "
                          "grid-stride loops, split-K for matmuls), and bigger batches.",
    "low_occupancy.registers": "Register pressure limits resident warps: __launch_bounds__ or -maxrregcount, "
                               "fewer live values per thread, or split the kernel.",
    "low_occupancy.shared": "Shared memory per block limits resident blocks: smaller tiles or fewer pipeline "
                            "stages in shared memory, or smaller blocks.",
    "low_occupancy.threads": "Block size limits resident blocks: use blocks of 128-256 threads.",
    "tensor_cores_unused.fp32": "Let the tensor cores do the matrix math{at}: a TF32 compute type "
                                "(CUBLAS_COMPUTE_32F_FAST_TF32 in cublasGemmEx / cublasLtMatmul, or "
                                "cublasSetMathMode(handle, CUBLAS_TF32_TENSOR_OP_MATH)) runs FP32 matmuls as TF32 on "
                                "them, about 8x the FP32 rate; BF16/FP16 inputs are faster still; cuDNN convolutions "
                                "need cudnnSetConvolutionMathType(desc, CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION).",
    "tensor_cores_unused.fp16": "Half-precision matrix math on the CUDA cores{at}: usually a shape the tensor-core "
                                "kernels cannot take; pad the matrix dimensions to multiples of 8 (16 for int8/fp8), "
                                "align the leading dimensions, and keep the arrays contiguous.",
    "tensor_cores_unused.fp64": "Double-precision matrix math{at} runs at a small fraction of the tensor cores' "
                                "FP32/bf16 rates: if the result does not need FP64, compute in FP32 with a TF32 "
                                "compute type, or in BF16.",
    "tensor_cores_unused.complex": _COMPLEX,
    "tensor_cores_unused.gemv": _GEMV,
    "elementwise_heavy": "Make fewer passes over memory: fuse the chain of element operations into one kernel that reads and "
                         "writes each array once (or let a compiler fuse them: nvFuser, XLA), write in place, and store in "
                         "bf16/fp16 to halve the bytes.",
}

# As for the verdicts: what a framework says in the CUDA-level words, explicitly.
_SAME_PRECISION = {"tensor_cores_unused.fp16", "tensor_cores_unused.complex"}  # the shapes and types, not the API
RULES_SAME_AS_CUDA = {
    "jax": {"low_occupancy.threads", "tensor_cores_unused.gemv", *_SAME_PRECISION},
    "tensorflow": {"low_occupancy.registers", "low_occupancy.shared", "low_occupancy.threads",
                   "tensor_cores_unused.gemv", *_SAME_PRECISION},
    "cupy": _SAME_PRECISION,
    "numba": {"tensor_cores_unused.gemv", *_SAME_PRECISION},
    "triton": {"pageable_memcpy", "sync_memcpy", "sync_memset", "sync_in_loop", "gpu_gaps", "tensor_cores_unused.fp64",
               "tensor_cores_unused.gemv", *_SAME_PRECISION},
    "cuda-python": set(_CUDA_RULES),
}

#: Per framework, trace rule -> its fix; low_occupancy by its limiter ("low_occupancy.grid") and
#: tensor_cores_unused by the precision of the math ("tensor_cores_unused.fp32"); {call}, {where} and {at} are
#: filled in by the rule that names them.
RULES: dict[str, dict[str, str]] = {
    name: {**{k: _CUDA_RULES[k] for k in RULES_SAME_AS_CUDA.get(name, ())}, **own}
    for name, own in (("torch", _TORCH_RULES), ("jax", _JAX_RULES), ("tensorflow", _TENSORFLOW_RULES),
                      ("cupy", _CUPY_RULES), ("numba", _NUMBA_RULES), ("triton", _TRITON_RULES),
                      ("cuda-python", {}), ("cuda", _CUDA_RULES))
}


# -- the lookups -----------------------------------------------------------------------------------------


def frameworks_of(processes: Iterable[object]) -> tuple[str, ...]:
    """The frameworks of some processes (anything with a `frameworks` attribute), each once, in FRAMEWORKS
    order."""
    found = {f for p in processes for f in (getattr(p, "frameworks", None) or ())}
    return tuple(f for f in FRAMEWORKS if f in found)


def leads(frameworks: Iterable[str]) -> tuple[str, ...]:
    """The frameworks that speak: the known ones, less helpers of another one present, less "cuda" beside a
    framework; ("cuda",) when none is known."""
    known = {f for f in frameworks if f in NAMES}
    out = tuple(f for f in FRAMEWORKS if f in known and f != "cuda" and not (_HELPER_OF.get(f, set()) & known))
    return out or ("cuda",)


def fixes(kind: str, frameworks: Iterable[str] = ()) -> list[str]:
    """The fixes of a verdict kind in the words of `frameworks` (those of the GPU's processes); the CUDA-level
    ones where none is known. [] for a kind that has none (tests/test_advice.py fails on it)."""
    who = leads(frameworks)
    if len(who) == 1:
        return list(VERDICTS[who[0]].get(kind, []))
    out: list[str] = []
    for name in who:
        words = VERDICTS[name].get(kind, [])
        if words and all(words == VERDICTS[n].get(kind) for n in who):
            return list(words)  # the same for all: said once, unnamed
        out.extend(f"{NAMES[name]}: {w}" for w in words)
    return out


def rule_fix(rule: str, frameworks: Iterable[str] = (), **params: object) -> str:
    """The fix of a trace finding (`rule`, or "low_occupancy.<limiter>") in the words of the traced process's
    `frameworks`, with the rule's {call} and {where} filled in; the CUDA-level one where none is known."""
    who = leads(frameworks)
    texts = [(name, RULES[name].get(rule, "")) for name in who]
    fill: Mapping[str, object] = _Defaults(params)
    filled = [(name, t.format_map(fill)) for name, t in texts if t]
    if len({t for _, t in filled}) <= 1:
        return filled[0][1] if filled else ""
    return " ".join(f"{NAMES[name]}: {t}" for name, t in filled)


class _Defaults(dict[str, object]):
    """Format parameters; a rule that names none of them still formats."""

    def __missing__(self, key: str) -> str:
        return {"call": "synchronisation", "where": "its line", "at": ""}.get(key, key)
