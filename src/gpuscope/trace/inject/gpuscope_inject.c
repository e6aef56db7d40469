/* gpuscope's CUDA injection library: `gpuscope trace -- ./any_cuda_program` for programs without Python.
 *
 * CUDA_INJECTION64_PATH=<this library> makes the driver load it at cuInit and call InitializeInjection().
 * It subscribes CUPTI as trace/cupti_backend.py does from Python (the same record kinds, the same windows,
 * the same launch sampling) and writes each window as JSON lines:
 *
 *   <GPUSCOPE_TRACE_DIR>/<host>.<pid>[.rank<N>][.w<k>].inject.jsonl   (".part" until the window is complete)
 *
 * first line an object (run, host, pid, rank, window, the clock pair at the start), then one JSON array
 * per record, shaped like the Python backend's plain tuples ("kernel", "memcpy", "memset", "sync",
 * "runtime"/"driver" with the call's native return addresses), then "frame", "cbid" and "device" lines
 * and a last object with the clock pair at the stop. gpuscope (trace/inject/convert.py) turns the file
 * into the Kineto-compatible trace after the program exits: building the trace there, not here, keeps
 * this library small and the trace format in one place (cupti_backend.to_kineto).
 *
 * <stem>.inject-status.json says what happened in the process (waiting, written, cupti_held, ...).
 *
 * Rules for code that runs inside someone else's program: never print, never abort, never fail a CUDA
 * call; every failure ends tracing in this process and is said in the status file only.
 *
 * Settings (environment, set by `gpuscope trace`): GPUSCOPE_TRACE_DIR (nothing happens without it),
 * GPUSCOPE_TRACE_DELAY_S, _DURATION_S, _EVERY_S, _MAX_DUTY, _API (rules|all), _STACK (1|0),
 * _LAUNCH_SAMPLES, _RUN, _CUPTI_BUFFER_MB; GPUSCOPE_TRACE_INJECT_SKIP_PYTHON=1 leaves processes that
 * run Python to the bootstrap.
 */
#define _GNU_SOURCE
/* Not <cupti.h>: it pulls in the runtime API's parameter structs, which need the CUDA compiler's crt/
 * headers; these need only cuda.h, which NVIDIA's runtime wheel has. */
#include <cupti_activity.h>
#include <cupti_callbacks.h>
#include <cupti_driver_cbid.h>
#include <cupti_result.h>
#include <cupti_runtime_cbid.h>
#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* The newest record structs of the CUPTI the library is built against: the builder reads them from
 * the headers (their names change with each CUPTI release; the fields used here do not). */
#ifndef GS_KERNEL_T
#define GS_KERNEL_T CUpti_ActivityKernel9
#endif
#ifndef GS_MEMCPY_T
#define GS_MEMCPY_T CUpti_ActivityMemcpy6
#endif
#ifndef GS_MEMSET_T
#define GS_MEMSET_T CUpti_ActivityMemset4
#endif
#ifndef GS_SYNC_T
#define GS_SYNC_T CUpti_ActivitySynchronization2
#endif
#ifndef GS_DEVICE_T
#define GS_DEVICE_T CUpti_ActivityDevice5
#endif

#define GS_EXPORT __attribute__((visibility("default")))
#define STACK_DEPTH 32
#define OPEN_DEPTH 8
#define MAX_CBID 4096
#define MAX_DEVICES 64
#define MAX_SLICES 64

typedef struct {
    uint64_t t0, t1;
    uint32_t corr, cbid, tid;
    uint8_t domain, nframes;
    void *frames[STACK_DEPTH];
} api_call;

typedef struct {
    uint32_t corr, cbid;
    uint8_t domain, nframes, launch_runtime;
    uint64_t t0;
    void *frames[STACK_DEPTH];
} open_call;

static struct {
    int on;  /* subscribed and well */
    pid_t pid;
    char dir[2048], stem[2400], host[256], run[128], exe[2048];
    int rank;
    double delay_s, duration_s, every_s, max_duty;
    int api_all, with_stack;
    long launch_budget;
    size_t buffer_bytes;
    CUpti_SubscriberHandle subscriber;
    uint8_t rule_ids[2][MAX_CBID], launch_ids[2][MAX_CBID], seen_ids[2][MAX_CBID];
    pthread_t thread;
    int thread_started;
    pthread_mutex_t lock;  /* the state below, the condition, the file */
    pthread_cond_t wake;
    int ctx_seen, exiting;
    uint64_t ctx_unix_ns;
    volatile int window_open;
    FILE *out;
    char part[2600], final[2560];
    api_call *calls;
    size_t ncalls, cap_calls;
    char *devices[MAX_DEVICES];
    /* launch sampling */
    pthread_mutex_t launch_lock;
    long launch_taken, launch_cap;
    int launch_on;
    long slices[MAX_SLICES];
    int nslices;
    uint64_t dropped;
    int refused_ids;
} g = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER,
       .launch_lock = PTHREAD_MUTEX_INITIALIZER, .rank = -1};

static __thread open_call t_open[OPEN_DEPTH];
static __thread int t_depth;
static __thread int t_in_runtime_launch;

/* -- small helpers ------------------------------------------------------------------------------------ */

static uint64_t now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static double env_number(const char *name, double fallback) {
    const char *v = getenv(name);
    if (!v || !*v) return fallback;
    char *end;
    double x = strtod(v, &end);
    return end == v ? fallback : x;
}

static void json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

static void clock_pair(FILE *f) {
    uint64_t cupti_ns = 0;
    cuptiGetTimestamp(&cupti_ns);
    fprintf(f, "{\"unix_ns\":%llu,\"cupti_ns\":%llu,\"monotonic_ns\":%llu}",
            (unsigned long long)now_ns(CLOCK_REALTIME), (unsigned long long)cupti_ns,
            (unsigned long long)now_ns(CLOCK_MONOTONIC));
}

/* The process's status file, replaced whole each time (a temporary name, then rename). */
static void write_status(const char *status, const char *error, int windows) {
    char tmp[2600], path[2600];
    snprintf(path, sizeof path, "%s.inject-status.json", g.stem);
    snprintf(tmp, sizeof tmp, "%s.inject-status.json.%d.tmp", g.stem, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fprintf(f, "{\"run\":");
    json_string(f, g.run);
    fprintf(f, ",\"host\":");
    json_string(f, g.host);
    fprintf(f, ",\"pid\":%d,\"rank\":", (int)g.pid);
    if (g.rank >= 0) fprintf(f, "%d", g.rank); else fprintf(f, "null");
    fprintf(f, ",\"status\":");
    json_string(f, status);
    fprintf(f, ",\"error\":");
    json_string(f, error ? error : "");
    fprintf(f, ",\"windows\":%d,\"cuda_initialised_unix_ns\":%llu,\"api\":\"%s\"}\n", windows,
            (unsigned long long)g.ctx_unix_ns, g.api_all ? "all" : "rules");
    if (fclose(f) == 0) rename(tmp, path);
    else unlink(tmp);
}

static const char *result_text(CUptiResult r) {
    const char *s = NULL;
    if (cuptiGetResultString(r, &s) != CUPTI_SUCCESS || !s) return "unknown CUPTI error";
    return s;
}

/* -- which calls: the same names as cupti_backend's _RULE_CALLS and _LAUNCH_CALLS ---------------------- */

static int starts(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

static int rule_call(const char *name) {
    static const char *what[] = {"Memcpy", "Memset", "Malloc", "MemAlloc", "Free", "MemFree", "MemHostAlloc",
                                 "DeviceSynchronize", "ThreadSynchronize", "CtxSynchronize", "StreamSynchronize",
                                 "EventSynchronize", NULL};
    const char *rest = starts(name, "cuda") ? name + 4 : starts(name, "cu") ? name + 2 : NULL;
    if (!rest) return 0;
    for (int i = 0; what[i]; i++)
        if (starts(rest, what[i])) return 1;
    return 0;
}

static int launch_call(const char *name) {
    static const char *base[] = {"cudaLaunchKernel", "cudaLaunchCooperativeKernel", "cudaGraphLaunch",
                                 "cuLaunchKernel", "cuLaunchCooperativeKernel", "cuGraphLaunch", NULL};
    static const char *suffix[] = {"ExC", "Ex", "MultiDevice", "", NULL};
    for (int i = 0; base[i]; i++) {
        if (!starts(name, base[i])) continue;
        const char *rest = name + strlen(base[i]);
        for (int j = 0; suffix[j]; j++) {
            if (!starts(rest, suffix[j])) continue;
            const char *tail = rest + strlen(suffix[j]);
            if (*tail == '\0' || *tail == '_') return 1;
        }
    }
    return 0;
}

static int domain_index(CUpti_CallbackDomain d) { return d == CUPTI_CB_DOMAIN_RUNTIME_API ? 0 : 1; }

static void classify_ids(void) {
    const CUpti_CallbackDomain domains[2] = {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_CB_DOMAIN_DRIVER_API};
    const uint32_t sizes[2] = {CUPTI_RUNTIME_TRACE_CBID_SIZE, CUPTI_DRIVER_TRACE_CBID_SIZE};
    for (int d = 0; d < 2; d++) {
        for (uint32_t id = 1; id < sizes[d] && id < MAX_CBID; id++) {
            const char *name = NULL;
            if (cuptiGetCallbackName(domains[d], id, &name) != CUPTI_SUCCESS || !name) continue;
            g.rule_ids[d][id] = (uint8_t)rule_call(name);
            g.launch_ids[d][id] = (uint8_t)launch_call(name);
        }
    }
}

/* -- CUPTI's callbacks (any thread; they never fail a CUDA call) -------------------------------------- */

static int take_launch(int domain) {
    if (domain == 1 && t_in_runtime_launch) return 0;  /* the driver launch of a sampled runtime launch */
    int taken = 0;
    pthread_mutex_lock(&g.launch_lock);
    if (g.launch_taken < g.launch_cap) {
        g.launch_taken++;
        taken = 1;
        if (g.launch_taken == g.launch_cap) pthread_cond_broadcast(&g.wake);  /* the sampler turns them off */
    }
    pthread_mutex_unlock(&g.launch_lock);
    return taken;
}

static void record_call(const open_call *o, uint64_t t1, uint32_t tid) {
    pthread_mutex_lock(&g.lock);
    if (g.window_open) {
        if (g.ncalls == g.cap_calls) {
            size_t cap = g.cap_calls ? g.cap_calls * 2 : 4096;
            api_call *grown = realloc(g.calls, cap * sizeof *grown);
            if (grown) {
                g.calls = grown;
                g.cap_calls = cap;
            }
        }
        if (g.ncalls < g.cap_calls) {
            api_call *c = &g.calls[g.ncalls++];
            c->t0 = o->t0;
            c->t1 = t1;
            c->corr = o->corr;
            c->cbid = o->cbid;
            c->tid = tid;
            c->domain = o->domain;
            c->nframes = o->nframes;
            memcpy(c->frames, o->frames, o->nframes * sizeof(void *));
        }
    }
    pthread_mutex_unlock(&g.lock);
}

static void CUPTIAPI on_callback(void *userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
                                 const void *data) {
    (void)userdata;
    if (domain == CUPTI_CB_DOMAIN_RESOURCE) {
        if (cbid == CUPTI_CBID_RESOURCE_CONTEXT_CREATED) {
            pthread_mutex_lock(&g.lock);
            if (!g.ctx_seen) {
                g.ctx_seen = 1;
                g.ctx_unix_ns = now_ns(CLOCK_REALTIME);
                pthread_cond_broadcast(&g.wake);
            }
            pthread_mutex_unlock(&g.lock);
        }
        return;
    }
    if ((domain != CUPTI_CB_DOMAIN_RUNTIME_API && domain != CUPTI_CB_DOMAIN_DRIVER_API) || cbid >= MAX_CBID) return;
    const CUpti_CallbackData *cb = (const CUpti_CallbackData *)data;
    int d = domain_index(domain);
    if (cb->callbackSite == CUPTI_API_ENTER) {
        if (!g.window_open) return;
        int launch = g.launch_ids[d][cbid] && !g.api_all;
        if (launch && !take_launch(d)) return;
        if (t_depth >= OPEN_DEPTH) {  /* an exit never seen (a call that never returned): forget the oldest */
            memmove(&t_open[0], &t_open[1], (OPEN_DEPTH - 1) * sizeof(open_call));
            t_depth--;
        }
        open_call *o = &t_open[t_depth++];
        o->corr = cb->correlationId;
        o->cbid = cbid;
        o->domain = (uint8_t)d;
        o->launch_runtime = (uint8_t)(launch && d == 0);
        if (o->launch_runtime) t_in_runtime_launch = 1;
        o->nframes = g.with_stack ? (uint8_t)backtrace(o->frames, STACK_DEPTH) : 0;
        cuptiGetTimestamp(&o->t0);  /* after the stack: its cost is not the call's */
        return;
    }
    if (!t_depth) return;  /* entered before the window, or not recorded */
    uint64_t t1 = 0;
    cuptiGetTimestamp(&t1);
    for (int i = t_depth - 1; i >= 0; i--) {
        if (t_open[i].corr != cb->correlationId || t_open[i].domain != d) continue;
        open_call o = t_open[i];
        memmove(&t_open[i], &t_open[i + 1], (size_t)(t_depth - 1 - i) * sizeof(open_call));
        t_depth--;
        if (o.launch_runtime) t_in_runtime_launch = 0;
        g.seen_ids[d][cbid] = 1;
        record_call(&o, t1, (uint32_t)syscall(SYS_gettid));
        return;
    }
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(8, g.buffer_bytes);
    *size = *buffer ? g.buffer_bytes : 0;
    *max_records = 0;
}

static void device_line(const GS_DEVICE_T *r) {
    if (r->id >= MAX_DEVICES) return;
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return;
    fprintf(f, "[\"device\",%u,{\"id\":%u,\"name\":", r->id, r->id);
    json_string(f, r->name);
    fprintf(f, ",\"totalGlobalMem\":%llu,\"computeMajor\":%u,\"computeMinor\":%u,\"maxThreadsPerBlock\":%u,"
               "\"maxThreadsPerMultiprocessor\":%u,\"maxBlocksPerMultiprocessor\":%u,\"regsPerBlock\":%u,"
               "\"regsPerMultiprocessor\":%u,\"warpSize\":%u,\"sharedMemPerBlock\":%u,"
               "\"sharedMemPerMultiprocessor\":%u,\"numSms\":%u}]\n",
            (unsigned long long)r->globalMemorySize, r->computeCapabilityMajor, r->computeCapabilityMinor,
            r->maxThreadsPerBlock, r->maxWarpsPerMultiprocessor * r->numThreadsPerWarp,
            r->maxBlocksPerMultiprocessor, r->maxRegistersPerBlock, r->maxRegistersPerMultiprocessor,
            r->numThreadsPerWarp, r->maxSharedMemoryPerBlock, r->maxSharedMemoryPerMultiprocessor,
            r->numMultiprocessors);
    fclose(f);
    pthread_mutex_lock(&g.lock);
    free(g.devices[r->id]);
    g.devices[r->id] = text;
    pthread_mutex_unlock(&g.lock);
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                      size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *rec = NULL;
    pthread_mutex_lock(&g.lock);
    FILE *f = g.out;
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        switch (rec->kind) {
        case CUPTI_ACTIVITY_KIND_DEVICE:
            pthread_mutex_unlock(&g.lock);
            device_line((const GS_DEVICE_T *)rec);
            pthread_mutex_lock(&g.lock);
            f = g.out;
            break;
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
            const GS_KERNEL_T *k = (const GS_KERNEL_T *)rec;
            if (!f) break;
            fprintf(f, "[\"kernel\",%llu,%llu,%u,%u,%u,%u,", (unsigned long long)k->start,
                    (unsigned long long)k->end, k->deviceId, k->contextId, k->streamId, k->correlationId);
            json_string(f, k->name);
            fprintf(f, ",[%d,%d,%d],[%d,%d,%d],%u,%u]\n", k->gridX, k->gridY, k->gridZ, k->blockX, k->blockY,
                    k->blockZ, (unsigned)k->registersPerThread,
                    (unsigned)(k->staticSharedMemory + k->dynamicSharedMemory));
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            const GS_MEMCPY_T *m = (const GS_MEMCPY_T *)rec;
            if (f)
                fprintf(f, "[\"memcpy\",%llu,%llu,%u,%u,%u,%u,%u,%u,%u,%llu]\n", (unsigned long long)m->start,
                        (unsigned long long)m->end, m->deviceId, m->contextId, m->streamId, m->correlationId,
                        m->copyKind, m->srcKind, m->dstKind, (unsigned long long)m->bytes);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            const GS_MEMSET_T *m = (const GS_MEMSET_T *)rec;
            if (f)
                fprintf(f, "[\"memset\",%llu,%llu,%u,%u,%u,%u,%u,%llu]\n", (unsigned long long)m->start,
                        (unsigned long long)m->end, m->deviceId, m->contextId, m->streamId, m->correlationId,
                        (unsigned)m->memoryKind, (unsigned long long)m->bytes);
            break;
        }
        case CUPTI_ACTIVITY_KIND_SYNCHRONIZATION: {
            const GS_SYNC_T *s = (const GS_SYNC_T *)rec;
            if (f)
                fprintf(f, "[\"sync\",%llu,%llu,%u,%u,%u,%u]\n", (unsigned long long)s->start,
                        (unsigned long long)s->end, s->contextId, s->streamId, s->correlationId, (unsigned)s->type);
            break;
        }
        default:
            break;
        }
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS) g.dropped += dropped;
    pthread_mutex_unlock(&g.lock);
    free(buffer);
}

/* -- windows --------------------------------------------------------------------------------------------- */

static const CUpti_ActivityKind KINDS[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                           CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_SYNCHRONIZATION};

/* Callbacks on or off: the rules' calls (or, with api all, every call) and, apart, the launch ids. */
static void switch_calls(int on) {
    const CUpti_CallbackDomain domains[2] = {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_CB_DOMAIN_DRIVER_API};
    for (int d = 0; d < 2; d++) {
        if (g.api_all) {
            cuptiEnableDomain((uint32_t)on, g.subscriber, domains[d]);
            continue;
        }
        for (uint32_t id = 1; id < MAX_CBID; id++)
            if (g.rule_ids[d][id] && cuptiEnableCallback((uint32_t)on, g.subscriber, domains[d], id) != CUPTI_SUCCESS)
                g.refused_ids++;
    }
}

static void switch_launches(int on) {
    const CUpti_CallbackDomain domains[2] = {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_CB_DOMAIN_DRIVER_API};
    if (g.api_all || g.launch_budget <= 0 || on == g.launch_on) return;
    g.launch_on = on;
    for (int d = 0; d < 2; d++)
        for (uint32_t id = 1; id < MAX_CBID; id++)
            if (g.launch_ids[d][id]) cuptiEnableCallback((uint32_t)on, g.subscriber, domains[d], id);
}

static int window_start(int window) {
    if (g.every_s > 0) snprintf(g.final, sizeof g.final, "%s.w%d.inject.jsonl", g.stem, window);
    else snprintf(g.final, sizeof g.final, "%s.inject.jsonl", g.stem);
    snprintf(g.part, sizeof g.part, "%s.part", g.final);
    FILE *f = fopen(g.part, "w");
    if (!f) return -1;
    setvbuf(f, NULL, _IOFBF, 1 << 20);
    fprintf(f, "{\"gpuscope_inject\":1,\"run\":");
    json_string(f, g.run);
    fprintf(f, ",\"host\":");
    json_string(f, g.host);
    fprintf(f, ",\"pid\":%d,\"rank\":", (int)g.pid);
    if (g.rank >= 0) fprintf(f, "%d", g.rank); else fprintf(f, "null");
    fprintf(f, ",\"exe\":");
    json_string(f, g.exe);
    fprintf(f, ",\"window\":%d,\"api\":\"%s\",\"with_stack\":%s,\"launch_budget\":%ld,\"cuda_initialised_unix_ns\":%llu,"
               "\"start\":", window, g.api_all ? "all" : "rules", g.with_stack ? "true" : "false",
            g.api_all ? 0 : g.launch_budget, (unsigned long long)g.ctx_unix_ns);
    clock_pair(f);
    fprintf(f, "}\n");
    pthread_mutex_lock(&g.launch_lock);
    g.launch_taken = 0;
    g.launch_cap = g.launch_budget - g.launch_budget / 2;
    g.nslices = 0;
    pthread_mutex_unlock(&g.launch_lock);
    pthread_mutex_lock(&g.lock);
    g.out = f;
    g.ncalls = 0;
    g.dropped = 0;
    g.window_open = 1;
    pthread_mutex_unlock(&g.lock);
    for (size_t i = 0; i < sizeof KINDS / sizeof KINDS[0]; i++) {
        CUptiResult r = cuptiActivityEnable(KINDS[i]);
        if (r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) return -2;
    }
    switch_calls(1);
    switch_launches(1);
    return 0;
}

static int cmp_ptr(const void *a, const void *b) {
    uintptr_t x = *(const uintptr_t *)a, y = *(const uintptr_t *)b;
    return x < y ? -1 : x > y;
}

/* Each distinct return address once, with what dladdr knows (the module, its load address, the nearest
 * exported symbol); the converter resolves the rest (symbols of the executable, lines) from the files. */
static void write_frames(FILE *f) {
    size_t n = 0;
    for (size_t i = 0; i < g.ncalls; i++) n += g.calls[i].nframes;
    if (!n) return;
    uintptr_t *all = malloc(n * sizeof *all);
    if (!all) return;
    size_t k = 0;
    for (size_t i = 0; i < g.ncalls; i++)
        for (int j = 0; j < g.calls[i].nframes; j++) all[k++] = (uintptr_t)g.calls[i].frames[j];
    qsort(all, n, sizeof *all, cmp_ptr);
    for (size_t i = 0; i < n; i++) {
        if (i && all[i] == all[i - 1]) continue;
        Dl_info info;
        memset(&info, 0, sizeof info);
        if (!dladdr((void *)all[i], &info)) {
            fprintf(f, "[\"frame\",%llu,null,0,null,0]\n", (unsigned long long)all[i]);
            continue;
        }
        fprintf(f, "[\"frame\",%llu,", (unsigned long long)all[i]);
        if (info.dli_fname) json_string(f, info.dli_fname); else fprintf(f, "null");
        fprintf(f, ",%llu,", (unsigned long long)(uintptr_t)info.dli_fbase);
        if (info.dli_sname) json_string(f, info.dli_sname); else fprintf(f, "null");
        fprintf(f, ",%llu]\n", (unsigned long long)(uintptr_t)info.dli_saddr);
    }
    free(all);
}

static void window_stop(double cost_so_far_s) {
    (void)cost_so_far_s;
    pthread_mutex_lock(&g.lock);
    g.window_open = 0;
    pthread_mutex_unlock(&g.lock);
    switch_launches(0);
    switch_calls(0);
    for (size_t i = 0; i < sizeof KINDS / sizeof KINDS[0]; i++) cuptiActivityDisable(KINDS[i]);
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    pthread_mutex_lock(&g.lock);
    FILE *f = g.out;
    g.out = NULL;
    const CUpti_CallbackDomain domains[2] = {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_CB_DOMAIN_DRIVER_API};
    for (size_t i = 0; i < g.ncalls; i++) {
        api_call *c = &g.calls[i];
        fprintf(f, "[\"%s\",%llu,%llu,%d,%u,%u,%u,[", c->domain ? "driver" : "runtime", (unsigned long long)c->t0,
                (unsigned long long)c->t1, (int)g.pid, c->tid, c->corr, c->cbid);
        for (int j = 0; j < c->nframes; j++)
            fprintf(f, j ? ",%llu" : "%llu", (unsigned long long)(uintptr_t)c->frames[j]);
        fprintf(f, "]]\n");
    }
    write_frames(f);
    for (int d = 0; d < 2; d++)
        for (uint32_t id = 1; id < MAX_CBID; id++) {
            const char *name = NULL;
            if (!g.seen_ids[d][id] || cuptiGetCallbackName(domains[d], id, &name) != CUPTI_SUCCESS || !name)
                continue;
            fprintf(f, "[\"cbid\",%d,%u,", d ? 1 : 2, id);  /* Kineto's domains: 1 driver, 2 runtime */
            json_string(f, name);
            fprintf(f, "]\n");
        }
    for (int i = 0; i < MAX_DEVICES; i++)
        if (g.devices[i]) fputs(g.devices[i], f);
    long taken = g.launch_taken;
    fprintf(f, "{\"stop\":");
    clock_pair(f);
    fprintf(f, ",\"records_dropped\":%llu,\"refused_callback_ids\":%d,\"launches_sampled\":%ld,\"launch_slices\":[",
            (unsigned long long)g.dropped, g.refused_ids, taken);
    for (int i = 0; i < g.nslices; i++) fprintf(f, i ? ",%ld" : "%ld", g.slices[i]);
    fprintf(f, "]}\n");
    g.ncalls = 0;
    pthread_mutex_unlock(&g.lock);
    if (fclose(f) == 0) rename(g.part, g.final);
}

static double mono_s(void) { return (double)now_ns(CLOCK_MONOTONIC) / 1e9; }

/* Waits until `until` (monotonic s) or the exit; 1 when the process is exiting. Caller holds g.lock. */
static int wait_until(double until) {
    while (!g.exiting) {
        double left = until - mono_s();
        if (left <= 0) return 0;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double at = (double)ts.tv_sec + ts.tv_nsec / 1e9 + (left > 0.5 ? 0.5 : left);
        ts.tv_sec = (time_t)at;
        ts.tv_nsec = (long)((at - (double)ts.tv_sec) * 1e9);
        pthread_cond_timedwait(&g.wake, &g.lock, &ts);
    }
    return 1;
}

/* The window's span, with the launch sampler: the first half of the budget goes to the window's first
 * launches, then slices of a twentieth of it, at most 10 ms once a second (as cupti_backend.py). */
static void window_span(double end) {
    double next_slice = 0, slice_end = 0;
    int in_slice = 0;
    long slice_before = 0;
    pthread_mutex_lock(&g.lock);
    while (!g.exiting && mono_s() < end) {
        double until = end;
        if (g.launch_on) until = in_slice ? slice_end : mono_s() + 0.05;
        else if (next_slice > 0 && next_slice < until) until = next_slice;
        wait_until(until < end ? until : end);
        if (g.exiting) break;
        pthread_mutex_lock(&g.launch_lock);
        long taken = g.launch_taken, cap = g.launch_cap;
        pthread_mutex_unlock(&g.launch_lock);
        double now = mono_s();
        if (g.launch_on && (taken >= cap || (in_slice && now >= slice_end))) {
            pthread_mutex_unlock(&g.lock);
            switch_launches(0);
            pthread_mutex_lock(&g.lock);
            if (g.nslices < MAX_SLICES && (taken > slice_before || !g.nslices)) g.slices[g.nslices++] = taken - slice_before;
            in_slice = 0;
            next_slice = now + 1.0;
        } else if (!g.launch_on && next_slice > 0 && now >= next_slice && taken < g.launch_budget) {
            long add = g.launch_budget / 20 > 0 ? g.launch_budget / 20 : 1;
            pthread_mutex_lock(&g.launch_lock);
            g.launch_cap = taken + add < g.launch_budget ? taken + add : g.launch_budget;
            pthread_mutex_unlock(&g.launch_lock);
            pthread_mutex_unlock(&g.lock);
            switch_launches(1);
            pthread_mutex_lock(&g.lock);
            in_slice = 1;
            slice_before = taken;
            slice_end = now + 0.01;
            next_slice = 0;
        }
    }
    pthread_mutex_unlock(&g.lock);
}

static void *window_thread(void *arg) {
    (void)arg;
    pthread_mutex_lock(&g.lock);
    while (!g.ctx_seen && !g.exiting) pthread_cond_wait(&g.wake, &g.lock);
    if (!g.ctx_seen) {
        pthread_mutex_unlock(&g.lock);
        write_status("no_cuda", "", 0);
        return NULL;
    }
    pthread_mutex_unlock(&g.lock);
    write_status("waiting", "", 0);
    double start_at = mono_s() + g.delay_s, next_allowed = 0;
    int window = 0;
    for (;;) {
        pthread_mutex_lock(&g.lock);
        int exiting = wait_until(start_at);
        pthread_mutex_unlock(&g.lock);
        if (exiting) {
            if (!window) write_status("exited_before_window", "", 0);
            return NULL;
        }
        double began = mono_s();
        int r = window_start(window);
        if (r != 0) {
            pthread_mutex_lock(&g.lock);
            g.window_open = 0;
            FILE *f = g.out;
            g.out = NULL;
            pthread_mutex_unlock(&g.lock);
            if (f) {
                fclose(f);
                unlink(g.part);
            }
            write_status(r == -2 ? "cupti_held" : "failed",
                         r == -2 ? "another profiler holds CUPTI (Nsight Systems, DCGM profiling ...)"
                                 : "cannot write the trace directory", window);
            return NULL;
        }
        window_span(began + g.duration_s);
        window_stop(mono_s() - began);
        window++;
        double cost_s = mono_s() - began;
        next_allowed = began + cost_s / g.max_duty;  /* the same hard budget as trace/ondemand.py's Budget */
        write_status("written", "", window);
        pthread_mutex_lock(&g.lock);
        int done = g.every_s <= 0 || g.exiting;
        pthread_mutex_unlock(&g.lock);
        if (done) return NULL;
        start_at = began + g.every_s > next_allowed ? began + g.every_s : next_allowed;
    }
}

/* -- the process's start and end ------------------------------------------------------------------------ */

static void at_exit(void) {
    if (!g.thread_started || getpid() != g.pid) return;
    pthread_mutex_lock(&g.lock);
    g.exiting = 1;
    pthread_cond_broadcast(&g.wake);
    pthread_mutex_unlock(&g.lock);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 300;  /* a window's export never holds the exit longer */
    pthread_timedjoin_np(g.thread, NULL, &ts);
}

static void after_fork_child(void) { g.thread_started = 0; g.window_open = 0; }

GS_EXPORT int InitializeInjection(void) {
    static int done;
    if (done) return 1;
    done = 1;
    const char *dir = getenv("GPUSCOPE_TRACE_DIR");
    if (!dir || !*dir || strlen(dir) >= sizeof g.dir - 1) return 1;
    /* A process that runs Python is the bootstrap's (its PyTorch profiler or cupti-python backend). */
    const char *skip = getenv("GPUSCOPE_TRACE_INJECT_SKIP_PYTHON");
    if (skip && strcmp(skip, "1") == 0 && dlsym(RTLD_DEFAULT, "Py_IsInitialized")) return 1;
    g.pid = getpid();
    ssize_t n = readlink("/proc/self/exe", g.exe, sizeof g.exe - 1);
    g.exe[n > 0 ? n : 0] = '\0';
    snprintf(g.dir, sizeof g.dir, "%s", dir);
    if (gethostname(g.host, sizeof g.host) != 0) snprintf(g.host, sizeof g.host, "localhost");
    g.host[sizeof g.host - 1] = '\0';
    const char *run = getenv("GPUSCOPE_TRACE_RUN");
    snprintf(g.run, sizeof g.run, "%s", run ? run : "");
    const char *rank_vars[] = {"RANK", "LOCAL_RANK", NULL};
    for (int i = 0; rank_vars[i]; i++) {
        const char *v = getenv(rank_vars[i]);
        if (v && *v && strspn(v, "0123456789") == strlen(v)) {
            g.rank = atoi(v);
            break;
        }
    }
    if (g.rank >= 0) snprintf(g.stem, sizeof g.stem, "%s/%s.%d.rank%d", g.dir, g.host, (int)g.pid, g.rank);
    else snprintf(g.stem, sizeof g.stem, "%s/%s.%d", g.dir, g.host, (int)g.pid);
    g.delay_s = env_number("GPUSCOPE_TRACE_DELAY_S", 5);
    g.duration_s = env_number("GPUSCOPE_TRACE_DURATION_S", 10);
    g.every_s = env_number("GPUSCOPE_TRACE_EVERY_S", 0);
    g.max_duty = env_number("GPUSCOPE_TRACE_MAX_DUTY", 0.01);
    if (!(g.max_duty > 0 && g.max_duty <= 1)) g.max_duty = 0.01;
    const char *api = getenv("GPUSCOPE_TRACE_API");
    g.api_all = api && strcmp(api, "all") == 0;
    const char *stack = getenv("GPUSCOPE_TRACE_STACK");
    g.with_stack = !(stack && strcmp(stack, "0") == 0);
    g.launch_budget = (long)env_number("GPUSCOPE_TRACE_LAUNCH_SAMPLES", 2000);
    if (g.launch_budget < 0) g.launch_budget = 0;
    double mb = env_number("GPUSCOPE_TRACE_CUPTI_BUFFER_MB", 32);
    g.buffer_bytes = (size_t)(mb >= 1 ? mb : 1) << 20;

    CUptiResult r = cuptiSubscribe(&g.subscriber, (CUpti_CallbackFunc)on_callback, NULL);
    if (r != CUPTI_SUCCESS) {
        write_status(r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED ? "cupti_held" : "cupti_failed",
                     r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
                         ? "another profiler holds CUPTI (Nsight Systems, DCGM profiling ...); only one CUPTI "
                           "subscriber can exist per process"
                         : result_text(r), 0);
        return 1;
    }
    if ((r = cuptiEnableCallback(1, g.subscriber, CUPTI_CB_DOMAIN_RESOURCE, CUPTI_CBID_RESOURCE_CONTEXT_CREATED))
            != CUPTI_SUCCESS
        || (r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed)) != CUPTI_SUCCESS) {
        cuptiUnsubscribe(g.subscriber);
        write_status("cupti_failed", result_text(r), 0);
        return 1;
    }
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DEVICE);  /* one record per GPU, kept for every window */
    classify_ids();
    if (g.with_stack) {  /* backtrace() loads libgcc_s at its first call: here, not inside a CUDA call */
        void *warm[2];
        backtrace(warm, 2);
    }
    g.on = 1;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 20);
    if (pthread_create(&g.thread, &attr, window_thread, NULL) == 0) {
        g.thread_started = 1;
        pthread_atfork(NULL, NULL, after_fork_child);
        atexit(at_exit);
    } else {
        write_status("failed", "cannot start the window thread", 0);
    }
    pthread_attr_destroy(&attr);
    return 1;
}
