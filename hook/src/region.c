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
#include <time.h>
#include <unistd.h>

#include "spinlock.h"
#include "vgpu.h"

static struct vgpu_region *region;
static int region_fd = -1;
static int my_slot = -1;
/* Set with my_slot (under attach_lock, before `attached`): this process's lock word and its slot's
 * usage, so that an allocation or a free computes neither. */
static uint64_t my_owner;
static uint64_t *my_used;
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

static uint64_t owner_word(pid_t pid, int slot) { return (uint64_t)(uint32_t)pid << 32 | (uint32_t)(slot + 1); }

/* Whether the holder named by `owner` is gone, seen by a process holding `slot`. A live process
 * keeps its slot's byte lock (region.h) until it dies; a slot is claimed (its byte locked) before
 * its claimer takes the region lock, so while a holder lives no one else can hold its slot. */
static int holder_dead(uint64_t owner, int slot) {
    pid_t pid = (pid_t)(owner >> 32);
    int64_t held = (int64_t)(owner & 0xffffffffu) - 1;
    if (pid == attached_pid) return 0;                 /* another thread of this process */
    if (held < 0 || held >= VGPU_MAX_PROCS) return 1; /* not a holder's word: scribbled */
    if (held == slot) return 1; /* this process holds that slot's byte: its previous owner died */
    return !vgpu_slot_alive(region_fd, (int)held);
}

__attribute__((noinline)) static void lock_contended(struct vgpu_region *r, int slot, uint64_t me) {
    for (unsigned spins = 1;; spins++) {
        uint64_t owner = __atomic_load_n(&r->lock, __ATOMIC_RELAXED);
        if (owner == 0) {
            if (__atomic_compare_exchange_n(&r->lock, &owner, me, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) return;
            continue;
        }
        if (spins < 64) {
            vgpu_cpu_relax();
            continue;
        }
        /* Held for long: its holder may have died holding it (its stores left half done). */
        if (holder_dead(owner, slot) &&
            __atomic_compare_exchange_n(&r->lock, &owner, me, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
            recompute_totals(r);
            return;
        }
        if (spins < 1024) {
            sched_yield();
        } else {
            struct timespec nap = {0, 50000}; /* a holder stopped (SIGSTOP, a debugger): don't burn a CPU */
            nanosleep(&nap, NULL);
        }
    }
}

static inline void lock_as(struct vgpu_region *r, int slot) {
    uint64_t me = owner_word(attached_pid, slot), free_word = 0;
    if (!__atomic_compare_exchange_n(&r->lock, &free_word, me, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
        lock_contended(r, slot, me);
}

/* Inline, as this process's slot: a free lock is taken by one compare-and-swap, on every
 * allocation and free. */
static inline void lock_mine(struct vgpu_region *r) {
    uint64_t free_word = 0;
    if (!__atomic_compare_exchange_n(&r->lock, &free_word, my_owner, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
        lock_contended(r, my_slot, my_owner);
}

void vgpu_region_lock(struct vgpu_region *r) { lock_mine(r); }

void vgpu_region_unlock(struct vgpu_region *r) { __atomic_store_n(&r->lock, 0, __ATOMIC_RELEASE); }

static int init_region(struct vgpu_region *r) {
    memset(r, 0, sizeof *r); /* the lock is free */
    r->version = VGPU_REGION_VERSION;
    __atomic_store_n(&r->magic, VGPU_REGION_MAGIC, __ATOMIC_RELEASE);
    return 0;
}

/* A region an older hook wrote (a container restarted onto a newer hook) starts afresh when no
 * process holds a slot any more: its processes are all dead, so none of its counts still holds.
 * While one lives, the region stays as it is and is refused (its lock is not this version's).
 * Under flock, so that processes starting together upgrade it once. */
static void upgrade_region(int fd, struct vgpu_region *r) {
    if (flock(fd, LOCK_EX) != 0) return;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = VGPU_SLOT_LOCK_BASE, .l_len = VGPU_MAX_PROCS};
    if (r->version < VGPU_REGION_VERSION && fcntl(fd, F_OFD_GETLK, &fl) == 0 && fl.l_type == F_UNLCK) init_region(r);
    flock(fd, LOCK_UN);
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
    if (r->magic == VGPU_REGION_MAGIC && r->version < VGPU_REGION_VERSION) upgrade_region(fd, r);
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
        __atomic_store_n(&r->proc[i].waiting[d], 0, __ATOMIC_RELAXED);
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

/* A slot is this process's once it holds the slot's byte lock (region.h); only then does it take
 * the region lock, as that slot's holder, to register (returning a dead former owner's memory
 * first). Free slots are tried first, then those of processes that may have died. */
static int claim_slot(struct vgpu_region *r) {
    for (int pass = 0; pass < 2; pass++) {
        for (uint32_t i = 0; i < VGPU_MAX_PROCS; i++) {
            int taken = i < procs_hw(r) && __atomic_load_n(&r->proc[i].pid, __ATOMIC_ACQUIRE);
            if (taken != pass || take_slot_lock((int)i) != 0) continue;
            lock_as(r, (int)i);
            if (r->proc[i].pid) reclaim_slot(r, i); /* its owner died: give its memory back */
            memset(r->proc[i].used, 0, sizeof r->proc[i].used);
            memset(r->proc[i].waiting, 0, sizeof r->proc[i].waiting);
            __atomic_store_n(&r->proc[i].pid, (int32_t)attached_pid, __ATOMIC_RELEASE);
            if (i >= r->procs_hw) __atomic_store_n(&r->procs_hw, i + 1, __ATOMIC_RELEASE);
            vgpu_region_unlock(r);
            return (int)i;
        }
    }
    return -1;
}

struct vgpu_region *vgpu_region_attach(void) {
    /* Double-checked: attached is stored (release) under attach_lock after region is set, and
     * cleared in a fork child (vgpu_region_after_fork_child), which therefore attaches anew; no
     * getpid() (a system call) on every allocation and launch. */
    if (__atomic_load_n(&attached, __ATOMIC_ACQUIRE)) return region;
    pid_t pid = getpid();
    pthread_mutex_lock(&attach_lock);
    if (attached_pid != pid) {
        attached_pid = pid; /* the region lock's holders are named by it */
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
            if (region && (my_slot = claim_slot(region)) >= 0) {
                my_owner = owner_word(pid, my_slot);
                my_used = region->proc[my_slot].used;
            } else if (region) {
                vgpu_log("region %s: all %d process slots are in use; refusing device memory", path,
                         VGPU_MAX_PROCS);
                region = NULL;
            }
        }
        __atomic_store_n(&attached, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&attach_lock);
    return region;
}

/* The attached region without a call once attached (allocations and frees ask on every call). */
static inline struct vgpu_region *attached_region(void) {
    return __atomic_load_n(&attached, __ATOMIC_ACQUIRE) ? region : vgpu_region_attach();
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

void vgpu_region_set_quota(int d, uint64_t memory_quota, int cores) {
    struct vgpu_region *r = vgpu_region_attach();
    if (!r || d < 0 || d >= VGPU_MAX_DEVICES) return;
    __atomic_store_n(&r->dev[d].memory_quota, memory_quota, __ATOMIC_RELAXED);
    __atomic_store_n(&r->dev[d].cores, (uint32_t)cores, __ATOMIC_RELAXED);
}

static inline int reserve_once(struct vgpu_region *r, int d, uint64_t bytes, uint64_t quota) {
    lock_mine(r);
    uint64_t used = r->dev[d].used;
    int ok = quota == VGPU_UNLIMITED || (bytes <= quota && used <= quota - bytes);
    if (ok) {
        __atomic_store_n(&r->dev[d].used, used + bytes, __ATOMIC_RELAXED);
        __atomic_store_n(&my_used[d], my_used[d] + bytes, __ATOMIC_RELAXED);
        /* Only here does `used` grow, so the peak is exact at the cost of one compare per allocation. */
        if (used + bytes > r->dev[d].peak) __atomic_store_n(&r->dev[d].peak, used + bytes, __ATOMIC_RELAXED);
    }
    vgpu_region_unlock(r);
    return ok ? 0 : -1;
}

int vgpu_region_reserve(int d, uint64_t bytes, uint64_t quota) {
    struct vgpu_region *r = attached_region();
    if (!r || d < 0) return -1;
    if (reserve_once(r, d, bytes, quota) == 0) return 0;
    /* Memory of a process that died moments ago may not be reclaimed yet. */
    if (vgpu_region_reclaim_dead() && reserve_once(r, d, bytes, quota) == 0) return 0;
    /* Counted where the quota says no, whichever API asked: the one place all refusals pass. */
    __atomic_add_fetch(&r->dev[d].refused, 1, __ATOMIC_RELAXED);
    return -1;
}

void vgpu_region_release(int d, uint64_t bytes) {
    struct vgpu_region *r = attached_region();
    if (!r || d < 0) return;
    lock_mine(r);
    uint64_t mine = my_used[d];
    if (bytes > mine) bytes = mine; /* never give back more than this process holds */
    __atomic_store_n(&r->dev[d].used, r->dev[d].used - bytes, __ATOMIC_RELAXED);
    __atomic_store_n(&my_used[d], mine - bytes, __ATOMIC_RELAXED);
    vgpu_region_unlock(r);
}

void vgpu_region_waiting(int d, int64_t bytes) {
    struct vgpu_region *r = attached_region();
    if (!r || d < 0 || d >= VGPU_MAX_DEVICES) return;
    __atomic_add_fetch(&r->proc[my_slot].waiting[d], (uint64_t)bytes, __ATOMIC_RELAXED);
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
    my_owner = 0;
    my_used = NULL;
    attached_pid = 0;
    attached = 0;
    pthread_mutex_init(&attach_lock, NULL);
}
