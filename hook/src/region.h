/* The shared accounting region of one container: a file mapped by all its processes.
 *
 * Memory: region->dev[d].used is the container's usage of GPU d; each process's share is kept in
 * its slot (proc[i].used[d]). Both change together under `lock`, a spinlock whose word names its
 * holder (pid and slot): a waiter that finds the holder's slot dead (below) takes the lock over and
 * recomputes the totals from the slots, which each change by one aligned 8-byte store (so any
 * instant of death leaves them exact). Taking and giving it are one atomic instruction each, where
 * a robust process-shared mutex costs about a hundred on every allocation and free.
 *
 * Liveness: a process owns slot i while it holds an open-file-description write lock on byte
 * VGPU_SLOT_LOCK_BASE + i of the file. The kernel drops the lock when the process dies (even by
 * SIGKILL) or execs, so a slot whose byte is unlocked belongs to a dead process and is reclaimed. */
#ifndef VGPU_REGION_H
#define VGPU_REGION_H

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#include "contract.h"

#define VGPU_MAX_PROCS 1024
#define VGPU_REGION_MAGIC 0x3147455253534554ull /* "TESSREG1" */
/* 2: the lock is region.c's owner word, not a pthread mutex. 3: per GPU the peak of used and the
 * count of refused allocations, which the node agent exports. 4: per process the memory its
 * allocations wait for (shortfall.c), which the node agent reads to evict best-effort neighbours. */
#define VGPU_REGION_VERSION 4
#define VGPU_SLOT_LOCK_BASE (1ll << 30)

struct vgpu_region_device {
    char uuid[VGPU_UUID_LEN];
    uint64_t memory_quota; /* informational, for metrics: the last one a process enforced */
    uint64_t used;  /* sum of the slots' used[d]; under lock */
    uint64_t peak;  /* the most `used` has been since the region was created; under lock */
    uint32_t cores;
    uint32_t elastic;
    /* Token bucket of device time (ns), refilled at cores% of wall time; under lock. */
    int64_t tokens_ns;
    uint64_t refilled_at_ns;
    /* Statistics; atomic adds. */
    uint64_t busy_ns;
    uint64_t throttled_ns;
    uint64_t launches;
    uint64_t refused; /* allocations refused by the memory quota */
};

struct vgpu_region_proc {
    int32_t pid; /* 0 = free */
    uint32_t reserved;
    uint64_t used[VGPU_MAX_DEVICES];
    /* Bytes of this process's allocations that the driver refused for lack of memory and that wait
     * for it (reserved in used[] all the while); written by the process alone, atomic adds. */
    uint64_t waiting[VGPU_MAX_DEVICES];
};

struct vgpu_region {
    uint64_t magic;
    uint32_t version;
    uint32_t devices;  /* entries of dev[] in use; grows only */
    uint32_t procs_hw; /* slots ever used (high-water mark); grows only */
    uint32_t reserved;
    uint64_t last_scan_ns; /* when a process last looked for dead slots */
    uint64_t lock; /* 0 = free, else the holder: pid << 32 | (slot + 1) (region.c) */
    struct vgpu_region_device dev[VGPU_MAX_DEVICES];
    struct vgpu_region_proc proc[VGPU_MAX_PROCS];
};

/* This process's view; vgpu_region_attach() must succeed before the other calls. */
struct vgpu_region *vgpu_region_attach(void);
/* Index of the GPU in the region, added if new; -1 if the region is full or unusable. */
int vgpu_region_device(const char *uuid, uint64_t memory_quota, int cores, int elastic);
/* The quotas a process enforces on device d now (informational, for metrics; a live resize). */
void vgpu_region_set_quota(int d, uint64_t memory_quota, int cores);
/* Reserves bytes on device d if the container's usage stays within quota: 0, or -1. */
int vgpu_region_reserve(int d, uint64_t bytes, uint64_t quota);
void vgpu_region_release(int d, uint64_t bytes);
/* This process's allocations on device d wait for bytes more (or, negative, no longer). */
void vgpu_region_waiting(int d, int64_t bytes);
uint64_t vgpu_region_used(int d);
/* Returns the memory of processes that died; returns how many slots were reclaimed. */
int vgpu_region_reclaim_dead(void);
/* r->devices bounded by VGPU_MAX_DEVICES (the file is the container's to scribble on). */
uint32_t vgpu_region_devices(const struct vgpu_region *r);
void vgpu_region_lock(struct vgpu_region *r);
void vgpu_region_unlock(struct vgpu_region *r);
void vgpu_region_after_fork_child(void);
/* 1 if the slot's owner holds its lock (is alive), judged through fd. */
int vgpu_slot_alive(int fd, int slot);

#endif
