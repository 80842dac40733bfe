/* The hook's one clock, for the token buckets, the region's scans and the monitor: monotonic, so
 * a change of the wall clock never refills or drains a bucket. */
#include <time.h>

#include "vgpu.h"

uint64_t vgpu_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}
