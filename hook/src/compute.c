/* SM time-slice quota. Each container has, per GPU, a token bucket of device time in the region,
 * refilled at cores% of wall time (all of it in elastic mode while no one else uses the GPU) and
 * charged with each launch's device time; a launch waits while the bucket is negative.
 *
 * A launch's device time is what CUDA events around it measured: every launch of a new launch
 * signature (function or graph, grid, block, shared memory) is measured, then one every few.
 * The estimate is the least of the recent measurements, since a kernel queued behind another
 * container's work measures longer than it ran.
 *
 * The host may run at most RUNAHEAD_NS of estimated work ahead of the last measurement known
 * complete: a GPU runs queued work in order, so a deep queue would make every other container's
 * kernels wait (and measure) long, and would keep running after this container is throttled. */
#define _GNU_SOURCE
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "symbols.h"
#include "vgpu.h"
#include "wrappers.h"

#define SAMPLE_EVERY_LAUNCHES 16
#define SAMPLE_EVERY_NS 1000000ull /* or after this much estimated work */
#define SAMPLES_KEPT 8
#define MAX_SIGNATURES 4096
#define MAX_PENDING 8
#define RUNAHEAD_NS 2000000ull
#define BURST_NS 100000000ull /* the bucket holds at most 100 ms of wall time at its rate */
#define MAX_SLEEP_NS 20000000ull /* re-read the rate at least this often while waiting */
#define MIN_SLEEP_NS 20000ull

struct launch_key {
    uint64_t fn;
    uint32_t grid[3];
    uint32_t block[3];
    uint32_t shmem;
};

struct signature {
    struct launch_key key;
    int used;
    int nsamples;
    int next_sample;
    int pending;
    uint64_t samples[SAMPLES_KEPT];
    uint64_t estimate_ns;
    uint32_t launches_since_sample;
    uint64_t work_since_sample_ns;
};

struct sample {
    CUevent start, end;
    struct signature *sig;
    int rdev;
    int charge; /* launched before its signature had an estimate: charge the measurement */
    uint64_t work_mark; /* launched_work once this launch was queued */
};

static struct signature signatures[MAX_SIGNATURES];
static struct signature overflow_signature; /* shared by launches once the table is full */
static struct sample pending[MAX_PENDING];
static int npending;
/* Estimated work this process launched, and how much of it is known complete. */
static uint64_t launched_work, completed_work;
static pthread_mutex_t compute_lock = PTHREAD_MUTEX_INITIALIZER;
static int throttling; /* 0 = not known yet, 1 = no GPU has a compute quota, 2 = some has */

static int throttling_configured(void) {
    /* Racing first callers compute the same answer from the same configuration: no lock needed. */
    int t = __atomic_load_n(&throttling, __ATOMIC_RELAXED);
    if (t) return t == 2;
    const struct vgpu_limits *c = vgpu_limits();
    int any = c->all.cores > 0 && c->all.cores < VGPU_MAX_CORES;
    for (int i = 0; i < c->file_devices; i++) any |= c->by_uuid[i].quota.cores > 0 && c->by_uuid[i].quota.cores < VGPU_MAX_CORES;
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) any |= c->by_ordinal[i].cores > 0 && c->by_ordinal[i].cores < VGPU_MAX_CORES;
    __atomic_store_n(&throttling, any ? 2 : 1, __ATOMIC_RELAXED);
    return any;
}

static struct signature *signature_of(const struct launch_key *key) {
    uint64_t h = key->fn * 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < 3; i++) h = (h ^ key->grid[i] ^ ((uint64_t)key->block[i] << 32)) * 0x100000001b3ull;
    h ^= key->shmem;
    for (size_t n = 0, i = (size_t)(h >> 40) % MAX_SIGNATURES; n < 64; n++, i = (i + 1) % MAX_SIGNATURES) {
        struct signature *s = &signatures[i];
        if (!s->used) {
            s->used = 1;
            s->key = *key;
            return s;
        }
        if (!memcmp(&s->key, key, sizeof *key)) return s;
    }
    return &overflow_signature;
}

static void sleep_ns(uint64_t ns) {
    struct timespec t = {.tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull)};
    while (nanosleep(&t, &t) != 0) {
    }
}

static double rate_of(const struct vgpu_device *d) {
    if (vgpu_limits()->elastic && vgpu_monitor_gpu_is_ours(d->rdev)) return 1.0;
    return d->quota.cores / (double)VGPU_MAX_CORES;
}

static void refill(struct vgpu_region_device *g, uint64_t now, double rate) {
    if (now > g->refilled_at_ns) {
        double cap = (double)BURST_NS * rate;
        double tokens = (double)g->tokens_ns + (double)(now - g->refilled_at_ns) * rate;
        g->tokens_ns = (int64_t)(tokens > cap ? cap : tokens);
    }
    g->refilled_at_ns = now;
}

static void charge(struct vgpu_region *r, int rdev, uint64_t ns) {
    vgpu_region_lock(r);
    r->dev[rdev].tokens_ns -= (int64_t)ns;
    vgpu_region_unlock(r);
    __atomic_add_fetch(&r->dev[rdev].busy_ns, ns, __ATOMIC_RELAXED);
}

/* Waits until the bucket is not negative, then charges cost. */
static void wait_for_tokens(struct vgpu_region *r, const struct vgpu_device *d, uint64_t cost) {
    uint64_t waited = 0;
    for (;;) {
        double rate = rate_of(d);
        uint64_t now = vgpu_now_ns();
        vgpu_region_lock(r);
        struct vgpu_region_device *g = &r->dev[d->rdev];
        refill(g, now, rate);
        int64_t deficit = -g->tokens_ns;
        if (deficit <= 0) g->tokens_ns -= (int64_t)cost;
        vgpu_region_unlock(r);
        if (deficit <= 0) break;
        uint64_t ns = (uint64_t)((double)deficit / rate);
        ns = ns > MAX_SLEEP_NS ? MAX_SLEEP_NS : ns < MIN_SLEEP_NS ? MIN_SLEEP_NS : ns;
        sleep_ns(ns);
        waited += ns;
    }
    __atomic_add_fetch(&r->dev[d->rdev].busy_ns, cost, __ATOMIC_RELAXED);
    __atomic_add_fetch(&r->dev[d->rdev].launches, 1, __ATOMIC_RELAXED);
    if (waited) __atomic_add_fetch(&r->dev[d->rdev].throttled_ns, waited, __ATOMIC_RELAXED);
}

/* Takes a finished measurement into its signature's estimate (and the bucket if owed). */
static void settle(struct vgpu_region *r, struct sample *s, int complete) {
    float ms = 0;
    int ok = complete && REAL(cuEventElapsedTime_v2)(&ms, s->start, s->end) == CUDA_SUCCESS && ms >= 0;
    uint64_t ns = (uint64_t)((double)ms * 1e6);
    pthread_mutex_lock(&compute_lock);
    struct signature *sig = s->sig;
    sig->pending--;
    if (complete && s->work_mark > completed_work) completed_work = s->work_mark;
    if (ok) {
        sig->samples[sig->next_sample] = ns;
        sig->next_sample = (sig->next_sample + 1) % SAMPLES_KEPT;
        if (sig->nsamples < SAMPLES_KEPT) sig->nsamples++;
        uint64_t least = UINT64_MAX;
        for (int i = 0; i < sig->nsamples; i++)
            if (sig->samples[i] < least) least = sig->samples[i];
        sig->estimate_ns = least;
    }
    pthread_mutex_unlock(&compute_lock);
    if (ok && s->charge) charge(r, s->rdev, ns);
    REAL(cuEventDestroy_v2)(s->start);
    REAL(cuEventDestroy_v2)(s->end);
}

/* Settles the finished measurements; with `oldest` or `of`, first waits for that one. */
static void collect(struct vgpu_region *r, int oldest, const struct signature *of) {
    struct sample done[MAX_PENDING];
    int ndone = 0, waited = -1;
    pthread_mutex_lock(&compute_lock);
    for (int i = 0; i < npending;) {
        int take = (oldest && i == 0) || (of && pending[i].sig == of);
        if (take && waited < 0) waited = ndone;
        else take = REAL(cuEventQuery)(pending[i].end) != CUDA_ERROR_NOT_READY;
        if (take) {
            done[ndone++] = pending[i];
            memmove(&pending[i], &pending[i + 1], (size_t)(npending - i - 1) * sizeof *pending);
            npending--;
        } else {
            i++;
        }
    }
    pthread_mutex_unlock(&compute_lock);
    /* Another thread is settling the one we were to wait for: let it finish. */
    if ((oldest || of) && waited < 0) sleep_ns(MIN_SLEEP_NS);
    for (int i = 0; i < ndone; i++) {
        int complete = i != waited || REAL(cuEventSynchronize)(done[i].end) == CUDA_SUCCESS;
        settle(r, &done[i], complete);
    }
}

typedef CUresult (*launch_fn)(const void *args);

static CUresult throttled_launch(const struct launch_key *key, CUstream stream, launch_fn go, const void *args) {
    CUresult err;
    const struct vgpu_device *d = vgpu_device_current(&err);
    struct vgpu_region *r = d && d->rdev >= 0 ? vgpu_region_attach() : NULL;
    if (!r || d->quota.cores <= 0 || d->quota.cores >= VGPU_MAX_CORES) return go(args);
    collect(r, 0, NULL);
    struct signature *sig;
    int must_measure, unknown;
    uint64_t estimate;
    for (;;) {
        pthread_mutex_lock(&compute_lock);
        sig = signature_of(key);
        unknown = sig->nsamples == 0;
        int busy = unknown && sig->pending; /* one unmeasured launch of a signature at a time */
        estimate = sig->estimate_ns;
        must_measure = unknown || sig->launches_since_sample + 1 >= SAMPLE_EVERY_LAUNCHES ||
                       sig->work_since_sample_ns + estimate >= SAMPLE_EVERY_NS;
        int full = npending && (npending == MAX_PENDING || launched_work - completed_work > RUNAHEAD_NS);
        pthread_mutex_unlock(&compute_lock);
        if (!busy && !full) break;
        collect(r, full && !busy, busy ? sig : NULL);
    }
    wait_for_tokens(r, d, estimate);
    CUevent start = NULL, end = NULL;
    if (must_measure && (REAL(cuEventCreate)(&start, CU_EVENT_DEFAULT) != CUDA_SUCCESS ||
                         REAL(cuEventCreate)(&end, CU_EVENT_DEFAULT) != CUDA_SUCCESS ||
                         REAL(cuEventRecord)(start, stream) != CUDA_SUCCESS)) {
        if (start) REAL(cuEventDestroy_v2)(start);
        if (end) REAL(cuEventDestroy_v2)(end);
        start = end = NULL;
        static int told;
        if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
            vgpu_log("cannot record CUDA events on a stream; its launches are not charged to the compute quota");
    }
    CUresult rc = go(args);
    int measured = start && rc == CUDA_SUCCESS && REAL(cuEventRecord)(end, stream) == CUDA_SUCCESS;
    pthread_mutex_lock(&compute_lock);
    if (measured && npending < MAX_PENDING) {
        launched_work += estimate;
        pending[npending++] = (struct sample){start, end, sig, d->rdev, unknown, launched_work};
        sig->pending++;
        sig->launches_since_sample = 0;
        sig->work_since_sample_ns = 0;
        start = NULL;
    } else {
        launched_work += estimate;
        sig->launches_since_sample++;
        sig->work_since_sample_ns += estimate;
    }
    pthread_mutex_unlock(&compute_lock);
    if (start) {
        REAL(cuEventDestroy_v2)(start);
        REAL(cuEventDestroy_v2)(end);
    }
    return rc;
}

struct kernel_launch {
    CUresult (*fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                   void **, void **);
    CUresult (*cooperative)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            CUstream, void **);
    CUfunction f;
    unsigned grid[3], block[3], shmem;
    CUstream stream;
    void **params, **extra;
};

static CUresult go_kernel(const void *p) {
    const struct kernel_launch *a = p;
    if (a->cooperative)
        return a->cooperative(a->f, a->grid[0], a->grid[1], a->grid[2], a->block[0], a->block[1], a->block[2],
                              a->shmem, a->stream, a->params);
    return a->fn(a->f, a->grid[0], a->grid[1], a->grid[2], a->block[0], a->block[1], a->block[2], a->shmem,
                 a->stream, a->params, a->extra);
}

static CUresult kernel(const struct kernel_launch *a) {
    if (!a->fn && !a->cooperative) return CUDA_ERROR_NOT_FOUND;
    if (!throttling_configured()) return go_kernel(a);
    struct launch_key key = {(uint64_t)(uintptr_t)a->f,
                             {a->grid[0], a->grid[1], a->grid[2]},
                             {a->block[0], a->block[1], a->block[2]},
                             a->shmem};
    return throttled_launch(&key, a->stream, go_kernel, a);
}

VGPU_API CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                         unsigned by, unsigned bz, unsigned shmem, CUstream stream, void **params,
                                         void **extra) {
    struct kernel_launch a = {REAL(cuLaunchKernel), NULL, f, {gx, gy, gz}, {bx, by, bz}, shmem, stream, params, extra};
    return kernel(&a);
}

VGPU_API CUresult CUDAAPI cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                              unsigned by, unsigned bz, unsigned shmem, CUstream stream,
                                              void **params, void **extra) {
    struct kernel_launch a = {REAL(cuLaunchKernel_ptsz), NULL, f, {gx, gy, gz}, {bx, by, bz}, shmem, stream, params, extra};
    return kernel(&a);
}

VGPU_API CUresult CUDAAPI cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                                    unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                                                    CUstream stream, void **params) {
    struct kernel_launch a = {NULL, REAL(cuLaunchCooperativeKernel), f, {gx, gy, gz}, {bx, by, bz}, shmem, stream, params, NULL};
    return kernel(&a);
}

VGPU_API CUresult CUDAAPI cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                                         unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                                                         CUstream stream, void **params) {
    struct kernel_launch a = {NULL, REAL(cuLaunchCooperativeKernel_ptsz), f, {gx, gy, gz}, {bx, by, bz}, shmem, stream, params, NULL};
    return kernel(&a);
}

struct ex_launch {
    CUresult (*fn)(const CUlaunchConfig *, CUfunction, void **, void **);
    const CUlaunchConfig *config;
    CUfunction f;
    void **params, **extra;
};

static CUresult go_ex(const void *p) {
    const struct ex_launch *a = p;
    return a->fn(a->config, a->f, a->params, a->extra);
}

static CUresult launch_ex(const struct ex_launch *a) {
    if (!a->fn) return CUDA_ERROR_NOT_FOUND;
    if (!throttling_configured() || !a->config) return go_ex(a);
    const CUlaunchConfig *c = a->config;
    struct launch_key key = {(uint64_t)(uintptr_t)a->f,
                             {c->gridDimX, c->gridDimY, c->gridDimZ},
                             {c->blockDimX, c->blockDimY, c->blockDimZ},
                             c->sharedMemBytes};
    return throttled_launch(&key, c->hStream, go_ex, a);
}

VGPU_API CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra) {
    struct ex_launch a = {REAL(cuLaunchKernelEx), config, f, params, extra};
    return launch_ex(&a);
}

VGPU_API CUresult CUDAAPI cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **params,
                                                void **extra) {
    struct ex_launch a = {REAL(cuLaunchKernelEx_ptsz), config, f, params, extra};
    return launch_ex(&a);
}

struct graph_launch {
    CUresult (*fn)(CUgraphExec, CUstream);
    CUgraphExec exec;
    CUstream stream;
};

static CUresult go_graph(const void *p) {
    const struct graph_launch *a = p;
    return a->fn(a->exec, a->stream);
}

static CUresult graph(const struct graph_launch *a) {
    if (!a->fn) return CUDA_ERROR_NOT_FOUND;
    if (!throttling_configured()) return go_graph(a);
    struct launch_key key = {(uint64_t)(uintptr_t)a->exec, {0, 0, 0}, {0, 0, 0}, 0};
    return throttled_launch(&key, a->stream, go_graph, a);
}

VGPU_API CUresult CUDAAPI cuGraphLaunch(CUgraphExec exec, CUstream stream) {
    struct graph_launch a = {REAL(cuGraphLaunch), exec, stream};
    return graph(&a);
}

VGPU_API CUresult CUDAAPI cuGraphLaunch_ptsz(CUgraphExec exec, CUstream stream) {
    struct graph_launch a = {REAL(cuGraphLaunch_ptsz), exec, stream};
    return graph(&a);
}

void vgpu_compute_after_fork_child(void) {
    /* The parent's events and estimates are not the child's. */
    memset(signatures, 0, sizeof signatures);
    memset(&overflow_signature, 0, sizeof overflow_signature);
    npending = 0;
    launched_work = completed_work = 0;
    pthread_mutex_init(&compute_lock, NULL);
}
