/* The shared accounting region: attach (create or map), slots, exact reservations, reclaiming dead
 * processes. See region.h for the invariants. It is data only: it uses the quotas' source
 * (limits.c), the clock and the log, and nothing that uses it; the monitor thread that keeps it is
 * started by devices.c. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "vgpu.h"

static struct vgpu_region *region;
static int region_fd = -1;
static int my_slot = -1;
static int region_private;
static pid_t attached_pid; /* the process that attached: a forked child attaches anew */
static int attached;        /* attached_pid is this process: cleared in a fork child */
static pthread_mutex_t attach_lock = PTHREAD_MUTEX_INITIALIZER;

int vgpu_slot_alive(int fd, int slot) {
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = VGPU_SLOT_LOCK_BASE + slot, .l_len = 1};
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return 1; /* cannot tell: keep it */
    return fl.l_type != F_UNLCK;
}

/* The counts as the layout bounds them: any process of the container can write the file, and a
 * forged count must not send the hook outside it. */
uint32_t vgpu_region_devices(const struct vgpu_region *r) {
    uint32_t n = __atomic_load_n(&r->devices, __ATOMIC_ACQUIRE);
    return n < VGPU_MAX_DEVICES ? n : VGPU_MAX_DEVICES;
}

static uint32_t procs_hw(const struct vgpu_region *r) {
    uint32_t n = __atomic_load_n(&r->procs_hw, __ATOMIC_ACQUIRE);
    return n < VGPU_MAX_PROCS ? n : VGPU_MAX_PROCS;
}

static void recompute_totals(struct vgpu_region *r) {
    for (uint32_t d = 0; d < vgpu_region_devices(r); d++) {
        uint64_t sum = 0;
        for (uint32_t i = 0; i < procs_hw(r); i++)
            if (r->proc[i].pid) sum += r->proc[i].used[d];
        r->dev[d].used = sum;
    }
}

void vgpu_region_lock(struct vgpu_region *r) {
    int rc = pthread_mutex_lock(&r->lock);
    if (rc == EOWNERDEAD) {
        /* A process died holding the lock, possibly between its two stores: the slots are the truth. */
        recompute_totals(r);
        pthread_mutex_consistent(&r->lock);
    }
}

void vgpu_region_unlock(struct vgpu_region *r) { pthread_mutex_unlock(&r->lock); }

static int init_region(struct vgpu_region *r) {
    memset(r, 0, sizeof *r);
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    int rc = pthread_mutex_init(&r->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    if (rc) return -1;
    r->version = VGPU_REGION_VERSION;
    __atomic_store_n(&r->magic, VGPU_REGION_MAGIC, __ATOMIC_RELEASE);
    return 0;
}

/* Maps the file, initialising it under flock when it is new; NULL after a message. */
static struct vgpu_region *map_region(int fd, const char *name) {
    struct stat st;
    struct vgpu_region *r = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof *r) {
        r = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (r != MAP_FAILED && __atomic_load_n(&r->magic, __ATOMIC_ACQUIRE) == VGPU_REGION_MAGIC) goto check;
    }
    if (flock(fd, LOCK_EX) != 0) goto fail;
    if (fstat(fd, &st) != 0 || ((size_t)st.st_size < sizeof *r && ftruncate(fd, sizeof *r) != 0)) {
        flock(fd, LOCK_UN);
        goto fail;
    }
    if (r == MAP_FAILED) r = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int ok = r != MAP_FAILED;
    if (ok && __atomic_load_n(&r->magic, __ATOMIC_ACQUIRE) == 0) ok = init_region(r) == 0;
    flock(fd, LOCK_UN);
    if (!ok) goto fail;
check:
    if (r->magic != VGPU_REGION_MAGIC || r->version != VGPU_REGION_VERSION) {
        vgpu_log("region %s: not a Tessera region of version %d; refusing device memory", name,
                 VGPU_REGION_VERSION);
        munmap(r, sizeof *r);
        return NULL;
    }
    return r;
fail:
    vgpu_log("region %s: %s; refusing device memory", name, strerror(errno));
    if (r != MAP_FAILED) munmap(r, sizeof *r);
    return NULL;
}

static int take_slot_lock(int slot) {
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = VGPU_SLOT_LOCK_BASE + slot, .l_len = 1};
    return fcntl(region_fd, F_OFD_SETLK, &fl);
}

static void reclaim_slot(struct vgpu_region *r, uint32_t i) {
    for (uint32_t d = 0; d < vgpu_region_devices(r); d++) {
        r->dev[d].used -= r->proc[i].used[d];
        __atomic_store_n(&r->proc[i].used[d], 0, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&r->proc[i].pid, 0, __ATOMIC_RELEASE);
}

static int reclaim_dead_locked(struct vgpu_region *r) {
    int reclaimed = 0;
    if (region_private) return 0;
    for (uint32_t i = 0; i < procs_hw(r); i++) {
        if ((int)i == my_slot || !r->proc[i].pid || vgpu_slot_alive(region_fd, (int)i)) continue;
        reclaim_slot(r, i);
        reclaimed++;
    }
    return reclaimed;
}

int vgpu_region_reclaim_dead(void) {
    struct vgpu_region *r = vgpu_region_attach();
    if (!r) return 0;
    vgpu_region_lock(r);
    int n = reclaim_dead_locked(r);
    __atomic_store_n(&r->last_scan_ns, vgpu_now_ns(), __ATOMIC_RELAXED);
    vgpu_region_unlock(r);
    return n;
}

static int claim_slot(struct vgpu_region *r) {
    vgpu_region_lock(r);
    int slot = -1;
    for (int pass = 0; pass < 2 && slot < 0; pass++) {
        if (pass == 1 && !reclaim_dead_locked(r)) break;
        for (uint32_t i = 0; i < VGPU_MAX_PROCS && slot < 0; i++) {
            if (i < r->procs_hw && r->proc[i].pid) continue;
            if (take_slot_lock((int)i) != 0) continue;
            slot = (int)i;
            memset(r->proc[i].used, 0, sizeof r->proc[i].used);
            __atomic_store_n(&r->proc[i].pid, (int32_t)getpid(), __ATOMIC_RELEASE);
            if (i >= r->procs_hw) __atomic_store_n(&r->procs_hw, i + 1, __ATOMIC_RELEASE);
        }
    }
    vgpu_region_unlock(r);
    return slot;
}

struct vgpu_region *vgpu_region_attach(void) {
    /* Double-checked: attached is stored (release) under attach_lock after region is set, and
     * cleared in a fork child (vgpu_region_after_fork_child), which therefore attaches anew; no
     * getpid() (a system call) on every allocation and launch. */
    if (__atomic_load_n(&attached, __ATOMIC_ACQUIRE)) return region;
    pid_t pid = getpid();
    pthread_mutex_lock(&attach_lock);
    if (attached_pid != pid) {
        const char *path = vgpu_limits()->region;
        region_private = !*path;
        region_fd = region_private ? memfd_create("tessera-region", MFD_CLOEXEC)
                                   : open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        region = NULL;
        if (region_fd < 0) {
            vgpu_log("region %s: %s; refusing device memory", path, strerror(errno));
        } else {
            if (!region_private) fchmod(region_fd, 0666); /* every user of the container shares it */
            region = map_region(region_fd, region_private ? "(private)" : path);
            if (region && (my_slot = claim_slot(region)) < 0) {
                vgpu_log("region %s: all %d process slots are in use; refusing device memory", path,
                         VGPU_MAX_PROCS);
                region = NULL;
            }
        }
        attached_pid = pid;
        __atomic_store_n(&attached, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&attach_lock);
    return region;
}

int vgpu_region_device(const char *uuid, uint64_t memory_quota, int cores, int elastic) {
    struct vgpu_region *r = vgpu_region_attach();
    if (!r) return -1;
    vgpu_region_lock(r);
    int d = -1;
    uint32_t devices = vgpu_region_devices(r);
    for (uint32_t i = 0; i < devices && d < 0; i++)
        if (!strncmp(r->dev[i].uuid, uuid, VGPU_UUID_LEN)) d = (int)i;
    if (d < 0 && devices < VGPU_MAX_DEVICES) {
        d = (int)devices;
        memset(&r->dev[d], 0, sizeof r->dev[d]);
        strncpy(r->dev[d].uuid, uuid, VGPU_UUID_LEN - 1);
        r->dev[d].refilled_at_ns = vgpu_now_ns();
        __atomic_store_n(&r->devices, (uint32_t)d + 1, __ATOMIC_RELEASE);
    }
    if (d >= 0) {
        r->dev[d].memory_quota = memory_quota;
        r->dev[d].cores = (uint32_t)cores;
        r->dev[d].elastic = (uint32_t)elastic;
    }
    vgpu_region_unlock(r);
    return d;
}

static int reserve_once(struct vgpu_region *r, int d, uint64_t bytes, uint64_t quota) {
    vgpu_region_lock(r);
    uint64_t used = r->dev[d].used;
    int ok = quota == VGPU_UNLIMITED || (bytes <= quota && used <= quota - bytes);
    if (ok) {
        __atomic_store_n(&r->dev[d].used, used + bytes, __ATOMIC_RELAXED);
        __atomic_store_n(&r->proc[my_slot].used[d], r->proc[my_slot].used[d] + bytes, __ATOMIC_RELAXED);
    }
    vgpu_region_unlock(r);
    return ok ? 0 : -1;
}

int vgpu_region_reserve(int d, uint64_t bytes, uint64_t quota) {
    struct vgpu_region *r = vgpu_region_attach();
    if (!r || d < 0) return -1;
    if (reserve_once(r, d, bytes, quota) == 0) return 0;
    /* Memory of a process that died moments ago may not be reclaimed yet. */
    return vgpu_region_reclaim_dead() ? reserve_once(r, d, bytes, quota) : -1;
}

void vgpu_region_release(int d, uint64_t bytes) {
    struct vgpu_region *r = vgpu_region_attach();
    if (!r || d < 0) return;
    vgpu_region_lock(r);
    uint64_t mine = r->proc[my_slot].used[d];
    if (bytes > mine) bytes = mine; /* never give back more than this process holds */
    __atomic_store_n(&r->dev[d].used, r->dev[d].used - bytes, __ATOMIC_RELAXED);
    __atomic_store_n(&r->proc[my_slot].used[d], mine - bytes, __ATOMIC_RELAXED);
    vgpu_region_unlock(r);
}

/* Without the lock, for reporting: the total is one aligned word, and a moment-old one will do. */
uint64_t vgpu_region_used(int d) {
    struct vgpu_region *r = vgpu_region_attach();
    return r && d >= 0 ? __atomic_load_n(&r->dev[d].used, __ATOMIC_RELAXED) : 0;
}

void vgpu_region_after_fork_child(void) {
    /* The parent keeps its slot (its lock lives on the open file description it still holds). */
    if (region) munmap(region, sizeof *region);
    if (region_fd >= 0) close(region_fd);
    region = NULL;
    region_fd = -1;
    my_slot = -1;
    attached_pid = 0;
    attached = 0;
    pthread_mutex_init(&attach_lock, NULL);
}
