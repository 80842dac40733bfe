/* The wait of a guaranteed allocation on a GPU whose memory best-effort neighbours borrow.
 *
 * A best-effort container placed against the GPU's measured use (an oversubscribed grant) holds
 * memory that latency-critical and standard containers were promised but had not used yet. When one
 * of those asks for it back, its allocation is within its quota (the region reserved it) but the
 * driver may refuse it for lack of memory. Then, where the limits file says the GPU is
 * oversubscribed (`oversubscribed <uuid> wait <ms>`), the allocation does not fail: it publishes how
 * many bytes it waits for in this process's region slot, where the node agent reads it and evicts
 * best-effort pods from the GPU, newest first, and is retried every nap until the driver gives the
 * memory or the wait is over (then the driver's refusal is returned, as without a neighbour). The
 * reservation is held all the while, so the best-effort containers' quotas, which the agent
 * computes from what the others hold, shrink by it at once: their new allocations are refused first.
 *
 * Only the driver's refusal comes here: an allocation that succeeds never pays for it (memory.c
 * tests one return code). */
#include <time.h>

#include "vgpu.h"

#define FIRST_NAP_NS 1000000ull /* 1 ms, doubling up to MAX_NAP_NS */
#define MAX_NAP_NS 20000000ull

struct vgpu_shortfall vgpu_shortfall_begin(const struct vgpu_device *d, uint64_t bytes) {
    uint64_t wait_ns = (uint64_t)vgpu_shortfall_wait_ms(d) * 1000000ull;
    vgpu_region_waiting(d->rdev, (int64_t)bytes);
    vgpu_log("GPU %s: the driver has no memory for %llu bytes within the quota; waiting up to %llu ms for "
             "best-effort neighbours to be evicted",
             d->uuid, (unsigned long long)bytes, (unsigned long long)(wait_ns / 1000000ull));
    return (struct vgpu_shortfall){.device = d, .bytes = bytes, .deadline_ns = vgpu_now_ns() + wait_ns};
}

int vgpu_shortfall_pause(struct vgpu_shortfall *s) {
    uint64_t now = vgpu_now_ns();
    if (now >= s->deadline_ns) return 0;
    uint64_t nap = FIRST_NAP_NS << (s->naps < 5 ? s->naps : 5);
    if (nap > MAX_NAP_NS) nap = MAX_NAP_NS;
    if (nap > s->deadline_ns - now) nap = s->deadline_ns - now;
    s->naps++;
    struct timespec t = {.tv_sec = (time_t)(nap / 1000000000ull), .tv_nsec = (long)(nap % 1000000000ull)};
    nanosleep(&t, NULL);
    return 1;
}

void vgpu_shortfall_end(struct vgpu_shortfall *s, CUresult r) {
    vgpu_region_waiting(s->device->rdev, -(int64_t)s->bytes);
    if (r == CUDA_SUCCESS)
        vgpu_log("GPU %s: %llu bytes allocated after waiting for memory", s->device->uuid,
                 (unsigned long long)s->bytes);
    else
        vgpu_log("GPU %s: no memory freed for %llu bytes within the wait; the allocation fails", s->device->uuid,
                 (unsigned long long)s->bytes);
}
