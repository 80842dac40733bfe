/* The read-only view of a region exported to Python (hook/region.py mirrors this struct, checked by
 * tests/hook/test_constants.py). */
#ifndef VGPU_SNAPSHOT_H
#define VGPU_SNAPSHOT_H

#include <stdint.h>

#include "contract.h"

struct vgpu_device_usage {
    char uuid[VGPU_UUID_LEN];
    uint64_t memory_used; /* by live processes only */
    uint64_t memory_quota;
    uint64_t busy_ns;
    uint64_t throttled_ns;
    uint64_t launches;
    uint64_t memory_peak; /* the most the container has held on the GPU, dead processes' memory included */
    uint64_t refused;     /* allocations refused by the memory quota */
    uint64_t memory_waiting; /* of memory_used, what allocations the driver refused wait for (live processes) */
    uint32_t cores;
    uint32_t elastic;
    uint32_t processes; /* live processes holding memory on the GPU */
    uint32_t reserved;
};

/* Fills out[0..capacity) with the region's GPUs; returns how many, or -errno: -EPROTO not a region
 * of this version, -ELOOP a symbolic link (never followed), -EINVAL not a regular file (a FIFO, a
 * directory...). *live receives the number of live processes attached. A region still being
 * created reads as no GPUs and no processes. Never blocks and never maps the file. */
int vgpu_region_read(const char *path, struct vgpu_device_usage *out, int capacity, int *live);
/* The same from a copy of the region's bytes; fd (the region's, or -1) answers which slots are
 * alive (-1: all of them). What vgpu_region_read runs after copying, and what the fuzzer drives. */
struct vgpu_region;
int vgpu_region_snapshot(const struct vgpu_region *r, int fd, struct vgpu_device_usage *out, int capacity,
                         int *live);
uint32_t vgpu_device_usage_size(void);

#endif
