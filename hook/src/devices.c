/* The GPUs this process's CUDA sees, each tied to its physical identity (UUID), so that the
 * accounting is per physical GPU whatever CUDA_VISIBLE_DEVICES reorders or hides; and joining a
 * GPU to the region, which starts the monitor. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "symbols.h"
#include "vgpu.h"

static struct vgpu_device devices[VGPU_MAX_DEVICES];
static int device_count;
static int devices_ready;
static pthread_mutex_t devices_lock = PTHREAD_MUTEX_INITIALIZER;

static void resize_quotas(void);

static void format_uuid(const CUuuid *uuid, char out[VGPU_UUID_LEN]) {
    const unsigned char *b = (const unsigned char *)uuid->bytes;
    snprintf(out, VGPU_UUID_LEN,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* The monitor is started here rather than by region.c: the region is the shared data, the monitor
 * one of its users (it reclaims dead processes' slots through region.c), so region.c needs nothing
 * that needs it. */
int vgpu_device_join(const char *uuid, struct vgpu_quota quota, int elastic) {
    int rdev = vgpu_region_device(uuid, quota.memory_quota, quota.cores, elastic);
    if (rdev >= 0 || vgpu_region_attach()) vgpu_monitor_ensure(resize_quotas);
    return rdev;
}

static CUresult enumerate(void) {
    CUresult err = CUDA_SUCCESS;
    pthread_mutex_lock(&devices_lock);
    if (devices_ready) goto out;
    if (!REAL(cuDeviceGetCount) || !REAL(cuDeviceGet) || !REAL(cuDeviceGetUuid_v2)) {
        err = CUDA_ERROR_NOT_FOUND;
        goto out;
    }
    int n = 0;
    if ((err = REAL(cuDeviceGetCount)(&n)) != CUDA_SUCCESS) goto out;
    if (n > VGPU_MAX_DEVICES) n = VGPU_MAX_DEVICES;
    int elastic = vgpu_limits()->elastic;
    for (int i = 0; i < n; i++) {
        struct vgpu_device *d = &devices[i];
        CUuuid uuid;
        if ((err = REAL(cuDeviceGet)(&d->cu, i)) != CUDA_SUCCESS ||
            (err = REAL(cuDeviceGetUuid_v2)(&uuid, d->cu)) != CUDA_SUCCESS)
            goto out;
        format_uuid(&uuid, d->uuid);
        d->quota = vgpu_quota_of(d->uuid, i);
        d->rdev = vgpu_device_join(d->uuid, d->quota, elastic);
        d->qos = vgpu_qos_join(d->rdev, d->uuid);
        d->governed = d->qos || vgpu_cores_limit(d->quota.cores);
    }
    device_count = n;
    __atomic_store_n(&devices_ready, 1, __ATOMIC_RELEASE);
out:
    pthread_mutex_unlock(&devices_lock);
    return err;
}

const struct vgpu_device *vgpu_device_of(CUdevice cu, CUresult *err) {
    /* devices_ready is stored (release) after the table is complete and never cleared while other
     * threads run (only in a fork child), so an acquire load that sees it sees the table. */
    if (!__atomic_load_n(&devices_ready, __ATOMIC_ACQUIRE) && (*err = enumerate()) != CUDA_SUCCESS) return NULL;
    /* A CUdevice is its ordinal in every driver we know of: try that slot first, then search. */
    if (cu >= 0 && cu < device_count && devices[cu].cu == cu) return &devices[cu];
    for (int i = 0; i < device_count; i++)
        if (devices[i].cu == cu) return &devices[i];
    *err = CUDA_ERROR_INVALID_DEVICE;
    return NULL;
}

const struct vgpu_device *vgpu_device_sole(void) {
    /* devices_ready: as in vgpu_device_of. */
    return __atomic_load_n(&devices_ready, __ATOMIC_ACQUIRE) && device_count == 1 ? &devices[0] : NULL;
}

/* The device of the current context, remembered per thread with that context: a launch or an
 * allocation asks the driver only for the current context (which it needs for the allocation's
 * owner anyway), not also for the context's device. A context's device never changes while it
 * lives; a handle may be reused by a new context once the old one ends, so every end of a context
 * the hook sees (memory.c), and a fork, moves contexts_epoch on, which forgets every thread's. The
 * epoch is read before the driver is asked, so an end racing with the lookup forgets its answer. */
static unsigned contexts_epoch;
/* initial-exec: one load from the thread pointer, not a __tls_get_addr call per launch; the hook is
 * preloaded (or dlopen'ed for its region reader, and its thread-locals, about 100 bytes with
 * compute.c's, fit glibc's static TLS surplus). */
static __thread __attribute__((tls_model("initial-exec"))) struct {
    CUcontext ctx;
    unsigned epoch;
    const struct vgpu_device *device;
} last_context;

void vgpu_device_contexts_ended(void) { __atomic_add_fetch(&contexts_epoch, 1, __ATOMIC_RELEASE); }

const struct vgpu_device *vgpu_device_current(CUcontext *current, CUresult *err) {
    unsigned epoch = __atomic_load_n(&contexts_epoch, __ATOMIC_ACQUIRE);
    CUcontext ctx = NULL;
    CUdevice cu;
    __typeof__(&cuCtxGetCurrent) get_current = REAL(cuCtxGetCurrent);
    if (!get_current) {
        *err = CUDA_ERROR_NOT_FOUND;
        return NULL;
    }
    if ((*err = get_current(&ctx)) != CUDA_SUCCESS) return NULL;
    if (current) *current = ctx;
    if (ctx && ctx == last_context.ctx && epoch == last_context.epoch) return last_context.device;
    if (!REAL(cuCtxGetDevice)) {
        *err = CUDA_ERROR_NOT_FOUND;
        return NULL;
    }
    if ((*err = REAL(cuCtxGetDevice)(&cu)) != CUDA_SUCCESS) return NULL;
    const struct vgpu_device *d = vgpu_device_of(cu, err);
    if (d && ctx) {
        last_context.ctx = ctx;
        last_context.epoch = epoch;
        last_context.device = d;
    }
    return d;
}

int vgpu_ordinal_of_uuid(const char *uuid) {
    if (!__atomic_load_n(&devices_ready, __ATOMIC_ACQUIRE)) {
        /* An NVML-only process: CUDA's enumeration decides what the ordinals mean. */
        vgpu_mps_apply(); /* the driver may not be initialised yet: it reads them now */
        if (!REAL(cuInit) || REAL(cuInit)(0) != CUDA_SUCCESS || enumerate() != CUDA_SUCCESS) return -1;
    }
    for (int i = 0; i < device_count; i++)
        if (!strcmp(devices[i].uuid, uuid)) return i;
    return -1;
}

/* Live resize (the monitor, every period): the devices' quotas become the limits file's. */
static void resize_quotas(void) {
    if (!vgpu_limits_resize()) return;
    /* Under the lock: a table being enumerated is complete first (or reads the new quotas itself). */
    pthread_mutex_lock(&devices_lock);
    for (int i = 0; i < device_count; i++) {
        struct vgpu_device *d = &devices[i];
        struct vgpu_quota q = vgpu_quota_of(d->uuid, i);
        __atomic_store_n(&d->quota.memory_quota, q.memory_quota, __ATOMIC_RELAXED);
        __atomic_store_n(&d->quota.cores, q.cores, __ATOMIC_RELAXED);
        __atomic_store_n(&d->quota.wait_ms, q.wait_ms, __ATOMIC_RELAXED);
        __atomic_store_n(&d->governed, d->qos || vgpu_cores_limit(q.cores), __ATOMIC_RELAXED);
        vgpu_region_set_quota(d->rdev, q.memory_quota, q.cores);
    }
    pthread_mutex_unlock(&devices_lock);
}

void vgpu_devices_after_fork_child(void) {
    /* Region indices belong to the region the child attaches anew. */
    devices_ready = 0;
    device_count = 0;
    vgpu_device_contexts_ended(); /* the forking thread's remembered device is the parent's */
    pthread_mutex_init(&devices_lock, NULL);
}
