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

/* A signature is measured once every SAMPLE_EVERY_LAUNCHES launches or after SAMPLE_EVERY_NS of
 * estimated work, whichever comes first: at most 1 ms of work between two measurements for any
 * kernel, as with one in 16 for kernels over 62 us (the bound is the work: a kernel over 16 us
 * reaches it first). A measurement costs about a thousand instructions (four driver calls and
 * settling it), so one in 64 rather than 16 takes about 50 off every launch of a short kernel. */
#define SAMPLE_EVERY_LAUNCHES 64
#define SAMPLE_EVERY_NS 1000000ull
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
    any |= c->from_file; /* a live resize may give a compute quota later: ask each device at launch */
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

static struct signature *signature_lookup(const struct launch_key *key);

/* Out of line: a miss is rare, and its hashing is not to be hoisted into the hit's path. */
__attribute__((noinline)) static struct signature *signature_miss(uint64_t fn, unsigned gx, unsigned gy, unsigned gz,
                                                                  unsigned bx, unsigned by, unsigned bz, unsigned shmem) {
    const struct launch_key key = {fn, {gx, gy, gz}, {bx, by, bz}, shmem};
    struct signature *s = signature_lookup(&key);
    if (s != &overflow_signature) {
        last_signature.sig = s;
        last_signature.epoch = signatures_epoch;
    }
    return s;
}

/* Lock held. The key comes in parts, so that the common case, a hit, builds no key. */
static inline struct signature *signature_of(uint64_t fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                             unsigned by, unsigned bz, unsigned shmem) {
    struct signature *s = last_signature.sig;
    if (s && last_signature.epoch == signatures_epoch && s->key.fn == fn && s->key.grid[0] == gx &&
        s->key.grid[1] == gy && s->key.grid[2] == gz && s->key.block[0] == bx && s->key.block[1] == by &&
        s->key.block[2] == bz && s->key.shmem == shmem)
        return s;
    return signature_miss(fn, gx, gy, gz, bx, by, bz, shmem);
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
 * had work in flight (qos.c) since the last refill: the rate applies to that whole interval, and a
 * latency-critical kernel queued behind this container's ends its published span (an estimate
 * without the queueing) before this container's next refill, so a check of that moment alone would
 * miss it. refilled_at_ns is read without the lock: a refill racing this read only makes the
 * interval checked longer (an older time), never shorter. */
static double rate_of(struct vgpu_region *r, const struct vgpu_device *d) {
    uint64_t since = __atomic_load_n(&r->dev[d->rdev].refilled_at_ns, __ATOMIC_RELAXED);
    if (vgpu_limits()->elastic && vgpu_monitor_gpu_is_ours(d->rdev) && !vgpu_qos_higher_busy(d->rdev, since))
        return 1.0;
    return vgpu_cores_quota(d) / (double)VGPU_MAX_CORES;
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
    __atomic_store_n(&g->refilled_at_ns, now, __ATOMIC_RELAXED); /* read without the lock by rate_of */
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
            double rate = rate_of(r, d);
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
    if (take_spare(ctx, start, end)) {
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
 * and publish their work. A launch without a class pays one branch for it. */
static inline __attribute__((always_inline)) void admit_classed(struct vgpu_region *r, const struct vgpu_device *d,
                                                                uint64_t estimate) {
    if (d->qos & VGPU_QOS_YIELDS) count_launch(&r->dev[d->rdev], estimate, vgpu_qos_yield(d->rdev, estimate));
    else if (d->qos & VGPU_QOS_SPATIAL) count_launch(&r->dev[d->rdev], estimate, 0);
    else if (vgpu_cores_limit(vgpu_cores_quota(d))) wait_for_tokens(r, d, estimate);
    else count_launch(&r->dev[d->rdev], estimate, 0);
    if (d->qos & VGPU_QOS_PUBLISHES) vgpu_qos_launched(r, d->rdev, estimate);
}

/* One launch that is measured, from its admission to its end event. */
struct launch {
    const struct vgpu_device *d;
    struct signature *sig;
    uint64_t estimate;
    int unknown; /* its signature had no estimate yet: the measurement is charged */
    CUcontext ctx;
    CUevent start, end;
};

/* A launch that admit decided to measure, from admit to the wrapper's measured path on the same
 * thread, which copies it at once (nothing else runs on the thread in between). A thread-local
 * rather than a local of the wrapper: the wrapper's common path, not measured, then makes the real
 * call as a sibling call, which a local whose address is passed on would rule out. initial-exec:
 * as last_signature. */
static __thread __attribute__((tls_model("initial-exec"))) struct launch admitted;

/* Admits a launch of the function (or graph) fn with this grid, block and shared memory on the
 * current context's GPU, waiting as its quota and class say, and accounts for it. 0: nothing more
 * to do (not measured, or the GPU is not governed), the caller makes the real call; 1: the caller
 * makes it in its measured path (admitted, measure_start, the call, measure_end).
 *
 * The GPU: where this process sees one GPU, every context is on it, so the driver is not asked for
 * the current context (vgpu_device_sole); a launch without one fails in the driver, and its
 * estimate is charged, as for any other launch the driver refuses. Inlined into each wrapper's
 * _throttled function, so that the launch's arguments stay where they are for the real call. */
static inline __attribute__((always_inline)) int admit(uint64_t fn, unsigned gx, unsigned gy, unsigned gz,
                                                       unsigned bx, unsigned by, unsigned bz, unsigned shmem) {
    CUresult err;
    const struct vgpu_device *d = vgpu_device_sole();
    if (!d) d = vgpu_device_current(NULL, &err);
    struct vgpu_region *r = d && vgpu_governed(d) && d->rdev >= 0 ? vgpu_region_attach() : NULL;
    if (!r) return 0;
    /* A relaxed read: a measurement queued meanwhile by another thread is collected next time. */
    if (__atomic_load_n(&npending, __ATOMIC_RELAXED)) collect(r, 0, NULL);
    struct signature *sig;
    int must_measure, unknown;
    uint64_t estimate;
    for (;;) {
        vgpu_spin_take(&compute_lock);
        sig = signature_of(fn, gx, gy, gz, bx, by, bz, shmem);
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
    if (!must_measure) return 0;
    admitted = (struct launch){d, sig, estimate, unknown, NULL, NULL, NULL};
    return 1;
}

/* Records the start event of an admitted launch that is measured. */
static void measure_start(struct launch *l, CUstream stream) {
    __typeof__(&cuCtxGetCurrent) get_current = REAL(cuCtxGetCurrent);
    if (!get_current || get_current(&l->ctx) != CUDA_SUCCESS || !l->ctx) return; /* the launch fails */
    if (start_measurement(l->ctx, stream, &l->start, &l->end) != 0) {
        static int told;
        if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
            vgpu_log("cannot record CUDA events on a stream; its launches are not charged to the compute quota");
    }
}

/* Records the end event of a measured launch that returned rc, and queues the measurement. */
static CUresult measure_end(struct launch *l, CUstream stream, CUresult rc) {
    int measured = l->start && rc == CUDA_SUCCESS && REAL(cuEventRecord)(l->end, stream) == CUDA_SUCCESS;
    struct signature *sig = l->sig;
    vgpu_spin_take(&compute_lock);
    launched_work += l->estimate;
    if (measured && npending < MAX_PENDING) {
        pending[npending] = (struct sample){l->start, l->end, l->ctx, sig, l->d->rdev, l->unknown, launched_work};
        __atomic_store_n(&npending, npending + 1, __ATOMIC_RELAXED);
        sig->pending++;
        sig->launches_since_sample = 0;
        sig->work_since_sample_ns = 0;
        l->start = NULL;
    } else {
        sig->launches_since_sample++;
        sig->work_since_sample_ns += l->estimate;
    }
    vgpu_spin_give(&compute_lock);
    if (l->start) {
        REAL(cuEventDestroy_v2)(l->start);
        REAL(cuEventDestroy_v2)(l->end);
    }
    return rc;
}

/* The measured path of a launch wrapper, where call is the real call. */
#define MEASURED(stream, call)                 \
    do {                                       \
        struct launch l = admitted;            \
        measure_start(&l, stream);             \
        return measure_end(&l, stream, call);  \
    } while (0)

/* A launch wrapper is three functions: the exported one makes the real call straight away when no
 * GPU has a compute quota or a class (one load of the real pointer, one of the configuration's
 * answer, then a sibling call; it calls nothing else, though GCC and clang both copy the five
 * arguments passed on the stack out and back in: 25 instructions in all), else hands over to its
 * out-of-line _throttled twin, also by a sibling call, which resolves the real function and the
 * configuration when they are not yet known, admits the launch and makes the real call, again as
 * a sibling call, unless the launch is measured: then the _measured one makes it. One function
 * instead of the first two costs the launch without a compute quota more than 50 instructions
 * (the throttled path's registers are saved on every path). */
#define KERNEL_PARAMS                                                                                              \
    CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shmem, \
        CUstream stream, void **params
#define KERNEL_ARGS f, gx, gy, gz, bx, by, bz, shmem, stream, params
#define KERNEL_ADMIT admit((uint64_t)(uintptr_t)f, gx, gy, gz, bx, by, bz, shmem)
#define LAUNCH_WRAPPER(name, per_thread, params_decl, args)                                       \
    __attribute__((noinline)) static CUresult name##_measured(__typeof__(&name) fn, params_decl) { \
        MEASURED(stream, fn(args));                                                               \
    }                                                                                             \
    __attribute__((noinline)) static CUresult name##_throttled(params_decl) {                     \
        __typeof__(&name) fn = REAL(name);                                                        \
        if (!fn) return CUDA_ERROR_NOT_FOUND;                                                     \
        if (!throttling_configured() || vgpu_capturing(stream, per_thread) || !KERNEL_ADMIT)      \
            return fn(args);                                                                      \
        return name##_measured(fn, args);                                                         \
    }                                                                                             \
    VGPU_API CUresult CUDAAPI name(params_decl) {                                                 \
        __typeof__(&name) fn = REAL_IF_RESOLVED(name);                                            \
        if (fn && __atomic_load_n(&throttling, __ATOMIC_RELAXED) == 1) return fn(args);           \
        return name##_throttled(args);                                                            \
    }

#define COMMA ,
LAUNCH_WRAPPER(cuLaunchKernel, 0, KERNEL_PARAMS COMMA void **extra, KERNEL_ARGS COMMA extra)
LAUNCH_WRAPPER(cuLaunchKernel_ptsz, 1, KERNEL_PARAMS COMMA void **extra, KERNEL_ARGS COMMA extra)
LAUNCH_WRAPPER(cuLaunchCooperativeKernel, 0, KERNEL_PARAMS, KERNEL_ARGS)
LAUNCH_WRAPPER(cuLaunchCooperativeKernel_ptsz, 1, KERNEL_PARAMS, KERNEL_ARGS)
#undef COMMA

/* cuLaunchKernelEx and cuGraphLaunch: one function each, the configuration known or not. */
#define EX_WRAPPER(name, per_thread)                                                                          \
    __attribute__((noinline)) static CUresult name##_measured(__typeof__(&name) fn, const CUlaunchConfig *config, \
                                                              CUfunction f, void **params, void **extra) {    \
        MEASURED(config->hStream, fn(config, f, params, extra));                                              \
    }                                                                                                         \
    VGPU_API CUresult CUDAAPI name(const CUlaunchConfig *config, CUfunction f, void **params, void **extra) { \
        __typeof__(&name) fn = REAL(name);                                                                    \
        if (!fn) return CUDA_ERROR_NOT_FOUND;                                                                 \
        if (!throttling_configured() || !config || vgpu_capturing(config->hStream, per_thread) ||             \
            !admit((uint64_t)(uintptr_t)f, config->gridDimX, config->gridDimY, config->gridDimZ,              \
                   config->blockDimX, config->blockDimY, config->blockDimZ, config->sharedMemBytes))          \
            return fn(config, f, params, extra);                                                              \
        return name##_measured(fn, config, f, params, extra);                                                 \
    }
EX_WRAPPER(cuLaunchKernelEx, 0)
EX_WRAPPER(cuLaunchKernelEx_ptsz, 1)

#define GRAPH_WRAPPER(name, per_thread)                                                                       \
    __attribute__((noinline)) static CUresult name##_measured(__typeof__(&name) fn, CUgraphExec exec,         \
                                                              CUstream stream) {                              \
        MEASURED(stream, fn(exec, stream));                                                                   \
    }                                                                                                         \
    VGPU_API CUresult CUDAAPI name(CUgraphExec exec, CUstream stream) {                                       \
        __typeof__(&name) fn = REAL(name);                                                                    \
        if (!fn) return CUDA_ERROR_NOT_FOUND;                                                                 \
        if (!throttling_configured() || vgpu_capturing(stream, per_thread) ||                                 \
            !admit((uint64_t)(uintptr_t)exec, 0, 0, 0, 0, 0, 0, 0))                                           \
            return fn(exec, stream);                                                                          \
        return name##_measured(fn, exec, stream);                                                             \
    }
GRAPH_WRAPPER(cuGraphLaunch, 0)
GRAPH_WRAPPER(cuGraphLaunch_ptsz, 1)

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
