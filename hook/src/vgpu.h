/* Internal declarations shared by the files of libvgpu.so. One concern per file:
 *   symbols.c   the one table of intercepted symbols, dlsym and cuGetProcAddress interception
 *   limits.c    the quotas: limits file, or standalone environment
 *   region.c    the shared accounting region of one container (mapped file)
 *   devices.c   CUDA ordinals and NVML devices mapped to physical GPUs (UUIDs); joins the region
 *   tracking.c  this process's live allocations (what each free gives back)
 *   memory.c    memory wrappers (memory quota)
 *   nvml.c      NVML memory wrappers
 *   shortfall.c the wait of an allocation the driver refused while best-effort neighbours borrow memory
 *   compute.c   launch wrappers (compute quota)
 *   capture.c   stream capture: which launches only record a graph
 *   mps.c       MPS mode: the environment the driver reads at cuInit
 *   qos.c       QoS classes: this container's slot of a GPU's coordination area, and its peers'
 *   monitor.c   background thread: dead processes, elastic neighbours
 *   process.c   fork handlers
 *   snapshot.c  the read-only region reader exported to Python
 *   clock.c     the monotonic clock
 *   log.c       messages on stderr
 *   spinlock.h  the lock of the process-local tables (tracking, compute)
 *
 * Calls go one way: the wrappers (memory, nvml, compute) use devices, tracking, the region and
 * limits (compute also the monitor's elastic verdict and qos.c; memory also shortfall.c, which uses
 * the region, the clock and the log); devices joins the region and starts the monitor and qos.c (the
 * monitor also refreshes qos.c's peers, and has devices.c resize its quotas to the limits file's:
 * live resize, through the function devices.c hands it at its start, so the monitor needs nothing of
 * devices.c); qos.c, tracking and snapshot use the region, which uses limits, the
 * clock and the log; process.c calls each file's fork handler. One link goes both ways: the one
 * explained in symbols.h. */
#ifndef VGPU_H
#define VGPU_H

#include <cuda.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#include "region.h"

#define VGPU_API __attribute__((visibility("default")))
#define VGPU_UNLIMITED UINT64_MAX

/* log.c */
void vgpu_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* symbols.c: real driver entry points, resolved from the library the client loaded. */
enum vgpu_library { VGPU_LIB_CUDA, VGPU_LIB_NVML, VGPU_LIB_DL };
void *vgpu_real(int symbol);

/* limits.c */
/* A container's QoS class on its GPUs (docs/hook.md, "QoS classes on the GPU"); 0 is standard, so a
 * zeroed configuration (fail closed) is the class without privileges over anyone. */
enum vgpu_qos { VGPU_QOS_CLASS_STANDARD = 0, VGPU_QOS_CLASS_LATENCY_CRITICAL, VGPU_QOS_CLASS_BEST_EFFORT };
/* A container's quota on one GPU. */
struct vgpu_quota {
    uint64_t memory_quota; /* memory quota in bytes; VGPU_UNLIMITED when not configured */
    int cores;       /* compute quota, 1..VGPU_MAX_CORES percent; 0 = none */
    /* Best-effort neighbours borrow this GPU's memory (the limits file's `oversubscribed` line): an
     * allocation within quota that the driver refuses for lack of memory waits up to this long for
     * the node agent to evict them, and is retried (shortfall.c). 0 = refused at once, as always. */
    int wait_ms;
};
/* The MPS client this container's processes are (mps.c): the control daemon's pipe directory ("" =
 * the GPU is time-sliced, no MPS), the share of each GPU's threads its kernels may use, and its
 * client priority (0 normal, 1 below normal). */
struct vgpu_mps {
    char pipe[PATH_MAX];
    int threads;
    int priority;
};

struct vgpu_limits {
    int refuse_memory; /* the limits file or the environment is broken: fail closed */
    char why[PATH_MAX + 512]; /* the first reason it was refused */
    int managed; /* in a container Tessera manages: only the limits file counts (limits.c) */
    int from_file;
    int elastic;
    char region[PATH_MAX]; /* "" = private to this process */
    enum vgpu_qos qos;
    char coordination[PATH_MAX]; /* the coordination areas' directory; "" = none (qos.c) */
    struct vgpu_mps mps;
    int file_devices;
    struct {
        char uuid[VGPU_UUID_LEN];
        struct vgpu_quota quota;
    } by_uuid[VGPU_MAX_DEVICES];
    struct vgpu_quota all;                          /* TESSERA_MEMORY_LIMIT, TESSERA_CORES */
    struct vgpu_quota by_ordinal[VGPU_MAX_DEVICES]; /* the _<i> variants; memory 0 / cores -1 = unset */
    int has_ordinal_quotas;
};
const struct vgpu_limits *vgpu_limits(void);
/* Whether a share of cores percent holds launches back (0 = none, 100 = the whole GPU). */
static inline int vgpu_cores_limit(int cores) { return cores > 0 && cores < VGPU_MAX_CORES; }
/* Parses a limits file's bytes (name is for messages) into l, which must start zeroed: 0, or -1 with
 * l->refuse_memory and l->why set. Pure: no I/O, no log. */
#define VGPU_LIMITS_MAX_BYTES 65536 /* a file of 16 devices takes about 2 KiB */
#define VGPU_LIMITS_MAX_LINE 1024
int vgpu_limits_parse(struct vgpu_limits *l, const char *text, size_t len, const char *name);
/* The quota of a GPU, by UUID (limits file) or by this process's CUDA ordinal (environment). */
struct vgpu_quota vgpu_quota_of(const char *uuid, int ordinal);
/* Live resize: re-reads the limits file if another file took its place; 1 if a quota changed. */
int vgpu_limits_resize(void);

/* devices.c: the GPUs this process's CUDA sees. */
struct vgpu_device {
    CUdevice cu;
    int rdev; /* index in the region, -1 if the region is unusable */
    char uuid[VGPU_UUID_LEN];
    struct vgpu_quota quota; /* changed by a live resize: read with the accessors below */
    int qos;      /* VGPU_QOS_* bits: what its launches do for the QoS classes (qos.c) */
    int governed; /* a compute quota or qos bits: its launches take compute.c's path */
};
/* The device's quotas as of now (the monitor stores a live resize's, atomically, while the wrappers
 * read). Each read is one volatile load of an aligned word (READ_ONCE): never torn, never cached,
 * and unlike the __atomic builtin it leaves LTO free to inline the allocation path (28 instructions
 * per allocation and free under callgrind, tests/hook/test_instruction_budget.py). */
static inline uint64_t vgpu_memory_quota(const struct vgpu_device *d) {
    return *(const volatile uint64_t *)&d->quota.memory_quota;
}
static inline int vgpu_cores_quota(const struct vgpu_device *d) { return *(const volatile int *)&d->quota.cores; }
static inline int vgpu_shortfall_wait_ms(const struct vgpu_device *d) {
    return *(const volatile int *)&d->quota.wait_ms;
}
static inline int vgpu_governed(const struct vgpu_device *d) { return *(const volatile int *)&d->governed; }
/* The device of the current context (and, if current is not NULL, that context); NULL with *err set
 * when there is none. */
const struct vgpu_device *vgpu_device_current(CUcontext *current, CUresult *err);
/* The one GPU this process sees, on which every context is; NULL when it sees several (or has not
 * enumerated them yet: vgpu_device_current does). */
const struct vgpu_device *vgpu_device_sole(void);
/* A context ended (destroyed, or a primary context released or reset): forget what was remembered. */
void vgpu_device_contexts_ended(void);
const struct vgpu_device *vgpu_device_of(CUdevice cu, CUresult *err);
/* Ordinal in this process of the GPU with this UUID, enumerating CUDA if needed; -1 if none. */
int vgpu_ordinal_of_uuid(const char *uuid);
/* The GPU's index in the region (added if new; -1 if the region is full or unusable). Every first
 * use of the region in a process comes through here, which starts the monitor. */
int vgpu_device_join(const char *uuid, struct vgpu_quota quota, int elastic);
void vgpu_devices_after_fork_child(void);

/* tracking.c */
enum vgpu_kind { VGPU_KIND_POINTER, VGPU_KIND_HANDLE, VGPU_KIND_ARRAY, VGPU_KIND_MIPMAP };
int vgpu_track_add(enum vgpu_kind kind, uint64_t key, int rdev, uint64_t bytes, CUcontext ctx);
/* 1 and the entry's device and size if the key was tracked (and is now forgotten), else 0. */
int vgpu_track_take(enum vgpu_kind kind, uint64_t key, int *rdev, uint64_t *bytes);
/* Forgets every allocation of ctx, returning its quota. */
void vgpu_track_drop_context(CUcontext ctx);
void vgpu_track_after_fork_child(void);

/* shortfall.c: an allocation within quota that the driver refused for lack of memory, on a GPU whose
 * memory best-effort neighbours borrow, waits for the node agent to free it (docs/hook.md). */
struct vgpu_shortfall {
    const struct vgpu_device *device;
    uint64_t bytes;
    uint64_t deadline_ns;
    int naps;
};
/* Publishes that bytes wait on d (in this process's region slot, where the node agent reads it). */
struct vgpu_shortfall vgpu_shortfall_begin(const struct vgpu_device *d, uint64_t bytes);
/* Sleeps a moment and returns 1 to retry, or 0 once the wait is over. */
int vgpu_shortfall_pause(struct vgpu_shortfall *s);
/* The allocation succeeded (r) or gave up: no longer waiting. */
void vgpu_shortfall_end(struct vgpu_shortfall *s, CUresult r);

/* compute.c */
void vgpu_compute_after_fork_child(void);
/* ctx ended (NULL: some context, not known which): forget the events kept in it. */
void vgpu_compute_context_ended(CUcontext ctx);

/* mps.c: sets the MPS client environment the limits give (nothing without an `mps` line), before
 * the driver's cuInit reads it. */
void vgpu_mps_apply(void);

/* capture.c: 1 when stream (NULL: the default stream, per-thread when per_thread) is capturing, so
 * that a launch on it records a graph node and runs nothing. One load while no capture is in
 * progress in this process. */
int vgpu_capturing(CUstream stream, int per_thread);
void vgpu_capture_after_fork_child(void);

/* qos.c: the coordination area of each GPU (docs/hook.md). */
#define VGPU_QOS_PUBLISHES 1 /* this container's launches are published in its slot */
#define VGPU_QOS_YIELDS 2    /* best-effort: launches wait while a higher class has work */
#define VGPU_QOS_SPATIAL 4   /* best-effort under MPS: no cap in time, no yield (MPS holds it back) */
/* Opens this container's slot and its peers' on GPU rdev, once per process (devices.c); returns
 * what its launches do there (VGPU_QOS_* bits), 0 when the GPU has no coordination area. */
int vgpu_qos_join(int rdev, const char *uuid);
/* Publishes that estimate_ns more of this container's work was queued on rdev. */
void vgpu_qos_launched(struct vgpu_region *r, int rdev, uint64_t estimate_ns);
/* Publishes that this container waits (syncing 1) or no longer waits (0) for its own kernels on
 * rdev, before it launches more (compute.c's run-ahead): its work is on the GPU. */
void vgpu_qos_syncing(struct vgpu_region *r, int rdev, int syncing);
/* Publishes that this container's next launch on rdev waits for its compute quota until due_ns. */
void vgpu_qos_due(struct vgpu_region *r, int rdev, uint64_t due_ns);
/* Best-effort: waits while a higher class has work in flight on rdev, or due before a kernel of
 * estimate_ns would end; returns the ns waited. */
uint64_t vgpu_qos_yield(int rdev, uint64_t estimate_ns);
/* 1 when a higher class than this container's has had work in flight on rdev at any time since
 * `since` (CLOCK_MONOTONIC ns; a span that ended after it counts), or has now. */
int vgpu_qos_higher_busy(int rdev, uint64_t since);
/* Opens the slots of containers that arrived, forgets those that left (the monitor, every period). */
void vgpu_qos_refresh(void);
void vgpu_qos_after_fork_child(void);

/* monitor.c: started once per process (by vgpu_device_join) once the region is joined; calls
 * resize_quotas every period (live resize). */
void vgpu_monitor_ensure(void (*resize_quotas)(void));
void vgpu_monitor_after_fork_child(void);
/* Elastic mode: 1 while NVML shows no other container's work on the GPU recently. */
int vgpu_monitor_gpu_is_ours(int rdev);

/* clock.c: CLOCK_MONOTONIC in nanoseconds. */
uint64_t vgpu_now_ns(void);

#endif
