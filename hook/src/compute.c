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

#include "spinlock.h"
#include "symbols.h"
#include "vgpu.h"
#include "wrappers.h"

#define SAMPLE_EVERY_LAUNCHES 16
#define SAMPLE_EVERY_NS 1000000ull /* or after this much estimated work */
#define SAMPLES_KEPT 16
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
    CUcontext ctx; /* the events' context */
    struct signature *sig;
    int rdev;
    int charge; /* launched before its signature had an estimate: charge the measurement */
    uint64_t work_mark; /* launched_work once this launch was queued */
};

/* Event pairs of settled measurements, kept for the next ones in the same context instead of being
 * destroyed and created again (four driver calls per measurement). An ended context's pairs are
 * forgotten (vgpu_compute_context_ended: the driver freed them); a pair that fails to record anyway
 * is destroyed and a new one created. Under compute_lock. */
#define SPARE_PAIRS MAX_PENDING
struct spare {
    CUcontext ctx;
    CUevent start, end;
};
static struct spare spares[SPARE_PAIRS];
static int nspares;

static struct signature signatures[MAX_SIGNATURES];
static struct signature overflow_signature; /* shared by launches once the table is full */
static struct sample pending[MAX_PENDING];
static int npending;
/* Estimated work this process launched, and how much of it is known complete. */
static uint64_t launched_work, completed_work;
/* Guards the signatures, the pending measurements and the work counters (spinlock.h: taken on every
 * throttled launch, held for a few loads and stores, and in collect for at most MAX_PENDING
 * cuEventQuery calls, which do not block). */
static vgpu_spinlock compute_lock;
static int throttling; /* 0 = not known yet, 1 = no GPU has a compute quota, 2 = some has */

/* The configuration's answer, computed once. Racing first callers compute the same answer from the
 * same configuration: no lock needed. */
__attribute__((noinline)) static int throttling_first(void) {
    const struct vgpu_limits *c = vgpu_limits();
    int any = vgpu_cores_limit(c->all.cores);
    for (int i = 0; i < c->file_devices; i++) any |= vgpu_cores_limit(c->by_uuid[i].quota.cores);
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) any |= vgpu_cores_limit(c->by_ordinal[i].cores);
    any |= c->qos != VGPU_QOS_CLASS_STANDARD || c->coordination[0]; /* qos.c needs each launch too */
    __atomic_store_n(&throttling, any ? 2 : 1, __ATOMIC_RELAXED);
    return any;
}

/* Inline, one load: every launch without a compute quota asks it and nothing more. */
static inline int throttling_configured(void) {
    int t = __atomic_load_n(&throttling, __ATOMIC_RELAXED);
    return t ? t == 2 : throttling_first();
}

/* The signature this thread launched last, to skip the hash and the probe when it launches the
 * same again (the common case: a loop). A table entry keeps its key until a fork clears the table,
 * which moves signatures_epoch on. Read and used under compute_lock, like the table. initial-exec:
 * one load from the thread pointer (devices.c says why that is safe here). */
static unsigned signatures_epoch;
static __thread __attribute__((tls_model("initial-exec"))) struct {
    struct signature *sig;
    unsigned epoch;
} last_signature;

static inline int same_key(const struct launch_key *a, const struct launch_key *b) {
    return a->fn == b->fn && a->grid[0] == b->grid[0] && a->grid[1] == b->grid[1] && a->grid[2] == b->grid[2] &&
           a->block[0] == b->block[0] && a->block[1] == b->block[1] && a->block[2] == b->block[2] &&
           a->shmem == b->shmem;
}

static struct signature *signature_lookup(const struct launch_key *key);

/* Lock held. */
static inline struct signature *signature_of(const struct launch_key *key) {
    struct signature *s = last_signature.sig;
    if (s && last_signature.epoch == signatures_epoch && same_key(&s->key, key)) return s;
    s = signature_lookup(key);
    if (s != &overflow_signature) {
        last_signature.sig = s;
        last_signature.epoch = signatures_epoch;
    }
    return s;
}

static struct signature *signature_lookup(const struct launch_key *key) {
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

/* Elastic mode expands only while no other container uses the GPU and no latency-critical one has
 * work in flight (qos.c). */
static double rate_of(const struct vgpu_device *d) {
    if (vgpu_limits()->elastic && vgpu_monitor_gpu_is_ours(d->rdev) && !vgpu_qos_higher_busy(d->rdev)) return 1.0;
    return d->quota.cores / (double)VGPU_MAX_CORES;
}

/* The bucket's level changes by atomic adds only (a launch's charge, a refill's credit), so that
 * charging needs no lock; refills are serialised by the region lock, which guards refilled_at_ns.
 * The credit is added by compare-and-swap, capped at the burst, so that no concurrent charge is
 * lost. Lock held. */
static void refill(struct vgpu_region_device *g, uint64_t now, double rate) {
    if (now > g->refilled_at_ns) {
        int64_t cap = (int64_t)((double)BURST_NS * rate);
        int64_t credit = (int64_t)((double)(now - g->refilled_at_ns) * rate);
        int64_t tokens = __atomic_load_n(&g->tokens_ns, __ATOMIC_RELAXED), fresh;
        do {
            fresh = tokens >= cap || cap - tokens < credit ? cap : tokens + credit;
        } while (!__atomic_compare_exchange_n(&g->tokens_ns, &tokens, fresh, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    }
    g->refilled_at_ns = now;
}

static void charge(struct vgpu_region *r, int rdev, uint64_t ns) {
    __atomic_sub_fetch(&r->dev[rdev].tokens_ns, (int64_t)ns, __ATOMIC_RELAXED);
    __atomic_add_fetch(&r->dev[rdev].busy_ns, ns, __ATOMIC_RELAXED);
}

static void count_launch(struct vgpu_region_device *g, uint64_t cost, uint64_t waited) {
    if (cost) __atomic_add_fetch(&g->busy_ns, cost, __ATOMIC_RELAXED);
    __atomic_add_fetch(&g->launches, 1, __ATOMIC_RELAXED);
    if (waited) __atomic_add_fetch(&g->throttled_ns, waited, __ATOMIC_RELAXED);
}

/* Waits until the bucket is not negative, then charges cost.
 *
 * Fast path, without the lock or the clock: a bucket that is not negative admits the launch, and
 * one atomic subtraction charges it (two launches racing on the last tokens both pass, as they
 * would one after the other under a lock: the bucket goes negative and the next launch waits).
 * The refill is only needed once the bucket is negative: a lazy refill grants the elapsed time x
 * the rate (capped at the burst) as refills at every launch would, so the share holds; only a rate
 * that changed meanwhile (elastic mode) is applied to the whole interval, within the burst. */
static inline __attribute__((always_inline)) void wait_for_tokens(struct vgpu_region *r, const struct vgpu_device *d,
                                                                  uint64_t cost) {
    struct vgpu_region_device *g = &r->dev[d->rdev];
    uint64_t waited = 0;
    if (__atomic_load_n(&g->tokens_ns, __ATOMIC_RELAXED) >= 0) {
        __atomic_sub_fetch(&g->tokens_ns, (int64_t)cost, __ATOMIC_RELAXED);
    } else {
        for (;;) {
            double rate = rate_of(d);
            uint64_t now = vgpu_now_ns();
            vgpu_region_lock(r);
            refill(g, now, rate);
            int64_t deficit = -__atomic_load_n(&g->tokens_ns, __ATOMIC_RELAXED);
            if (deficit <= 0) __atomic_sub_fetch(&g->tokens_ns, (int64_t)cost, __ATOMIC_RELAXED);
            vgpu_region_unlock(r);
            if (deficit <= 0) break;
            uint64_t ns = (uint64_t)((double)deficit / rate);
            ns = ns > MAX_SLEEP_NS ? MAX_SLEEP_NS : ns < MIN_SLEEP_NS ? MIN_SLEEP_NS : ns;
            if (d->qos & VGPU_QOS_PUBLISHES) vgpu_qos_due(r, d->rdev, now + ns);
            sleep_ns(ns);
            waited += ns;
        }
    }
    count_launch(g, cost, waited);
}

/* Takes a finished measurement into its signature's estimate (and the bucket if owed). */
static void settle(struct vgpu_region *r, struct sample *s, int complete) {
    float ms = 0;
    int ok = complete && REAL(cuEventElapsedTime_v2)(&ms, s->start, s->end) == CUDA_SUCCESS && ms >= 0;
    uint64_t ns = (uint64_t)((double)ms * 1e6);
    vgpu_spin_take(&compute_lock);
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
    int kept = ok && s->ctx && nspares < SPARE_PAIRS;
    if (kept) spares[nspares++] = (struct spare){s->ctx, s->start, s->end};
    vgpu_spin_give(&compute_lock);
    if (ok && s->charge) charge(r, s->rdev, ns);
    if (!kept) {
        REAL(cuEventDestroy_v2)(s->start);
        REAL(cuEventDestroy_v2)(s->end);
    }
}

/* A spare pair of this context's events, or 0. */
static int take_spare(CUcontext ctx, CUevent *start, CUevent *end) {
    int found = 0;
    vgpu_spin_take(&compute_lock);
    for (int i = 0; i < nspares && !found; i++) {
        if (spares[i].ctx != ctx) continue;
        *start = spares[i].start;
        *end = spares[i].end;
        spares[i] = spares[--nspares];
        found = 1;
    }
    vgpu_spin_give(&compute_lock);
    return found;
}

/* Records the start event of a measured launch, in a spare pair of ctx or a new one; 0 or -1. */
static int start_measurement(CUcontext ctx, CUstream stream, CUevent *start, CUevent *end) {
    if (ctx && take_spare(ctx, start, end)) {
        if (REAL(cuEventRecord)(*start, stream) == CUDA_SUCCESS) return 0;
        REAL(cuEventDestroy_v2)(*start); /* its context ended unseen: a new pair below */
        REAL(cuEventDestroy_v2)(*end);
    }
    *start = *end = NULL;
    if (REAL(cuEventCreate)(start, CU_EVENT_DEFAULT) == CUDA_SUCCESS &&
        REAL(cuEventCreate)(end, CU_EVENT_DEFAULT) == CUDA_SUCCESS && REAL(cuEventRecord)(*start, stream) == CUDA_SUCCESS)
        return 0;
    if (*start) REAL(cuEventDestroy_v2)(*start);
    if (*end) REAL(cuEventDestroy_v2)(*end);
    *start = *end = NULL;
    return -1;
}

void vgpu_compute_context_ended(CUcontext ctx) {
    vgpu_spin_take(&compute_lock);
    for (int i = 0; i < nspares;)
        if (spares[i].ctx == ctx || !ctx) spares[i] = spares[--nspares];
        else i++;
    vgpu_spin_give(&compute_lock);
}

/* Settles the finished measurements; with `oldest` or `of`, first waits for that one. */
static void collect(struct vgpu_region *r, int oldest, const struct signature *of) {
    struct sample done[MAX_PENDING];
    int ndone = 0, waited = -1;
    vgpu_spin_take(&compute_lock);
    for (int i = 0; i < npending;) {
        int take = (oldest && i == 0) || (of && pending[i].sig == of);
        if (take && waited < 0) waited = ndone;
        else take = REAL(cuEventQuery)(pending[i].end) != CUDA_ERROR_NOT_READY;
        if (take) {
            done[ndone++] = pending[i];
            memmove(&pending[i], &pending[i + 1], (size_t)(npending - i - 1) * sizeof *pending);
            __atomic_store_n(&npending, npending - 1, __ATOMIC_RELAXED); /* read unlocked by launches */
        } else {
            i++;
        }
    }
    vgpu_spin_give(&compute_lock);
    /* Another thread is settling the one we were to wait for: let it finish. */
    if ((oldest || of) && waited < 0) sleep_ns(MIN_SLEEP_NS);
    for (int i = 0; i < ndone; i++) {
        int complete = 1;
        if (i == waited) {
            vgpu_qos_syncing(r, done[i].rdev, 1); /* best-effort neighbours must not slip in ahead */
            complete = REAL(cuEventSynchronize)(done[i].end) == CUDA_SUCCESS;
            vgpu_qos_syncing(r, done[i].rdev, 0);
        }
        settle(r, &done[i], complete);
    }
}

/* A launch of a container with a QoS class on a GPU with a coordination area (qos.c): best-effort
 * has no share of its own, only the time that higher classes leave; the others keep their quota
 * and publish their work. Out of line: a launch without a class pays one branch for it. */
__attribute__((noinline)) static void admit_classed(struct vgpu_region *r, const struct vgpu_device *d,
                                                    uint64_t estimate) {
    if (d->qos & VGPU_QOS_YIELDS) count_launch(&r->dev[d->rdev], estimate, vgpu_qos_yield(d->rdev, estimate));
    else if (vgpu_cores_limit(d->quota.cores)) wait_for_tokens(r, d, estimate);
    else count_launch(&r->dev[d->rdev], estimate, 0);
    if (d->qos & VGPU_QOS_PUBLISHES) vgpu_qos_launched(r, d->rdev, estimate);
}

typedef CUresult (*launch_fn)(const void *args);

static CUresult throttled_launch(const struct launch_key *key, CUstream stream, launch_fn go, const void *args) {
    CUresult err;
    CUcontext ctx = NULL;
    const struct vgpu_device *d = vgpu_device_current(&ctx, &err);
    struct vgpu_region *r = d && d->rdev >= 0 ? vgpu_region_attach() : NULL;
    if (!r || !d->governed) return go(args);
    /* A relaxed read: a measurement queued meanwhile by another thread is collected next time. */
    if (__atomic_load_n(&npending, __ATOMIC_RELAXED)) collect(r, 0, NULL);
    struct signature *sig;
    int must_measure, unknown;
    uint64_t estimate;
    for (;;) {
        vgpu_spin_take(&compute_lock);
        sig = signature_of(key);
        unknown = sig->nsamples == 0;
        int busy = unknown && sig->pending; /* one unmeasured launch of a signature at a time */
        estimate = sig->estimate_ns;
        must_measure = unknown || sig->launches_since_sample + 1 >= SAMPLE_EVERY_LAUNCHES ||
                       sig->work_since_sample_ns + estimate >= SAMPLE_EVERY_NS;
        int full = npending && (npending == MAX_PENDING || launched_work - completed_work > RUNAHEAD_NS);
        if (!busy && !full && !must_measure) {
            /* Not measured: its accounting is known now, and done under this one lock. */
            launched_work += estimate;
            sig->launches_since_sample++;
            sig->work_since_sample_ns += estimate;
        }
        vgpu_spin_give(&compute_lock);
        if (!busy && !full) break;
        collect(r, full && !busy, busy ? sig : NULL);
    }
    if (__builtin_expect(d->qos, 0)) admit_classed(r, d, estimate);
    else wait_for_tokens(r, d, estimate);
    if (!must_measure) return go(args);
    CUevent start = NULL, end = NULL;
    if (start_measurement(ctx, stream, &start, &end) != 0) {
        static int told;
        if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
            vgpu_log("cannot record CUDA events on a stream; its launches are not charged to the compute quota");
    }
    CUresult rc = go(args);
    int measured = start && rc == CUDA_SUCCESS && REAL(cuEventRecord)(end, stream) == CUDA_SUCCESS;
    vgpu_spin_take(&compute_lock);
    if (measured && npending < MAX_PENDING) {
        launched_work += estimate;
        pending[npending] = (struct sample){start, end, ctx, sig, d->rdev, unknown, launched_work};
        __atomic_store_n(&npending, npending + 1, __ATOMIC_RELAXED);
        sig->pending++;
        sig->launches_since_sample = 0;
        sig->work_since_sample_ns = 0;
        start = NULL;
    } else {
        launched_work += estimate;
        sig->launches_since_sample++;
        sig->work_since_sample_ns += estimate;
    }
    vgpu_spin_give(&compute_lock);
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
    struct launch_key key = {(uint64_t)(uintptr_t)a->f,
                             {a->grid[0], a->grid[1], a->grid[2]},
                             {a->block[0], a->block[1], a->block[2]},
                             a->shmem};
    return throttled_launch(&key, a->stream, go_kernel, a);
}

/* A launch wrapper is two functions with the same parameters: the exported one makes the real call
 * straight away when no GPU has a compute quota (one load of the real pointer, one of the
 * configuration's answer, then a sibling call, with no stack frame of its own: it calls nothing
 * else), else hands over to its out-of-line _throttled twin, also by a sibling call, which resolves
 * the real function and the configuration when they are not yet known. */
#define KERNEL_PARAMS                                                                                              \
    CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shmem, \
        CUstream stream, void **params
#define KERNEL_ARGS f, gx, gy, gz, bx, by, bz, shmem, stream, params
#define LAUNCH_WRAPPER(name, throttled, params_decl, args)                                   \
    VGPU_API CUresult CUDAAPI name(params_decl) {                                            \
        __typeof__(&name) fn = REAL_IF_RESOLVED(name);                                       \
        if (fn && __atomic_load_n(&throttling, __ATOMIC_RELAXED) == 1) return fn(args);      \
        return throttled(args);                                                              \
    }

#define KERNEL_WRAPPER(name)                                                                                 \
    __attribute__((noinline)) static CUresult name##_throttled(KERNEL_PARAMS, void **extra) {               \
        struct kernel_launch a = {REAL(name), NULL, f, {gx, gy, gz}, {bx, by, bz}, shmem, stream, params, extra}; \
        if (!a.fn) return CUDA_ERROR_NOT_FOUND;                                                              \
        return throttling_configured() ? kernel(&a) : go_kernel(&a);                                         \
    }                                                                                                        \
    LAUNCH_WRAPPER(name, name##_throttled, KERNEL_PARAMS COMMA void **extra, KERNEL_ARGS COMMA extra)

#define COOPERATIVE_WRAPPER(name)                                                                            \
    __attribute__((noinline)) static CUresult name##_throttled(KERNEL_PARAMS) {                             \
        struct kernel_launch a = {NULL, REAL(name), f, {gx, gy, gz}, {bx, by, bz}, shmem, stream, params, NULL}; \
        if (!a.cooperative) return CUDA_ERROR_NOT_FOUND;                                                     \
        return throttling_configured() ? kernel(&a) : go_kernel(&a);                                         \
    }                                                                                                        \
    LAUNCH_WRAPPER(name, name##_throttled, KERNEL_PARAMS, KERNEL_ARGS)

#define COMMA ,
KERNEL_WRAPPER(cuLaunchKernel)
KERNEL_WRAPPER(cuLaunchKernel_ptsz)
COOPERATIVE_WRAPPER(cuLaunchCooperativeKernel)
COOPERATIVE_WRAPPER(cuLaunchCooperativeKernel_ptsz)
#undef COMMA

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
    signatures_epoch++; /* the forking thread's last signature was cleared */
    memset(&overflow_signature, 0, sizeof overflow_signature);
    npending = 0;
    nspares = 0; /* the parent's events */
    launched_work = completed_work = 0;
    vgpu_spin_init(&compute_lock);
}
