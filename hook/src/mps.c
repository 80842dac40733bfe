/* MPS mode (docs/hook.md, "MPS mode"). On a GPU whose node agent runs an MPS control daemon, the
 * kernels of every container run in one server context, side by side, instead of in time slices of
 * separate contexts. Measured on an H200 (docs/benchmarks.md): a time-sliced GPU makes a
 * latency-critical request wait about one time slice (1.3 ms) beside any batch work, whatever the
 * hook does at launch; under MPS, a best-effort client at priority below normal and held to half of
 * the GPU's threads leaves a latency-critical service within 1.4x of its latency alone, and itself
 * keeps two thirds of its rate.
 *
 * The driver reads the client's settings from the environment once, at cuInit. The limits file
 * (written by the node agent, which decides them by class) is the authority, so the hook sets them
 * just before the real cuInit runs, over whatever the container's own environment says: a process
 * cannot leave the daemon, raise its thread share or its priority by changing its environment.
 * setenv only runs when a value differs (in practice once per process, at the first cuInit: later
 * calls find the values set), so a thread reading the environment meanwhile sees a whole value. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "symbols.h"
#include "vgpu.h"

static void set(const char *name, const char *value) {
    const char *now = getenv(name);
    if (!now || strcmp(now, value)) setenv(name, value, 1);
}

void vgpu_mps_apply(void) {
    const struct vgpu_mps *mps = &vgpu_limits()->mps;
    if (!mps->pipe[0]) return;
    char threads[8];
    snprintf(threads, sizeof threads, "%d", mps->threads);
    set("CUDA_MPS_PIPE_DIRECTORY", mps->pipe);
    set("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", threads);
    set("CUDA_MPS_CLIENT_PRIORITY", mps->priority ? "1" : "0");
}

VGPU_API CUresult CUDAAPI cuInit(unsigned int flags) {
    __typeof__(&cuInit) fn = REAL(cuInit);
    if (!fn) return CUDA_ERROR_NOT_FOUND;
    vgpu_mps_apply();
    return fn(flags);
}
