/* Stream capture. A launch on a capturing stream runs nothing: it records a node of a graph
 * (PyTorch's CUDA graphs, torch.compile's reduce-overhead mode). The compute quota must neither
 * charge it nor measure it: an event recorded in a capture is a graph node too, and querying it
 * invalidates the capture (on a real H200, torch.cuda.graph failed under a 30% quota until this).
 * The graph's launches (cuGraphLaunch) are what the quota governs.
 *
 * Asking the driver whether a stream captures costs a call, so the hook counts the captures this
 * process has in progress and asks only while there is one. The count is an atomic: a capture
 * begins and ends on the thread that holds its stream, and a launch that reads a stale count either
 * asks once more than needed or (a capture begun on another thread at that instant, on another
 * stream) does not ask about a stream that is not capturing anyway. */
#define _GNU_SOURCE
#include "symbols.h"
#include "vgpu.h"
#include "wrappers.h"

static int captures_in_progress;

static CUresult begun(CUresult rc) {
    if (rc == CUDA_SUCCESS) __atomic_add_fetch(&captures_in_progress, 1, __ATOMIC_RELAXED);
    return rc;
}

/* An end that ended a capture (with its graph, or invalidated) is counted off; one refused for
 * another reason (not capturing, wrong thread) ended nothing. Never below zero: a capture begun
 * before the hook was loaded can end through it. */
static CUresult ended(CUresult rc) {
    if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_STREAM_CAPTURE_INVALIDATED) return rc;
    int n = __atomic_load_n(&captures_in_progress, __ATOMIC_RELAXED);
    while (n > 0 &&
           !__atomic_compare_exchange_n(&captures_in_progress, &n, n - 1, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return rc;
}

int vgpu_capturing(CUstream stream, int per_thread) {
    if (!__atomic_load_n(&captures_in_progress, __ATOMIC_RELAXED)) return 0;
    if (!stream) stream = per_thread ? CU_STREAM_PER_THREAD : CU_STREAM_LEGACY;
    if (stream == CU_STREAM_LEGACY) return 0; /* never captures; asking may be an error mid-capture */
    __typeof__(&cuStreamIsCapturing) is_capturing = REAL(cuStreamIsCapturing);
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    return is_capturing && is_capturing(stream, &status) == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE;
}

void vgpu_capture_after_fork_child(void) { captures_in_progress = 0; /* the child's streams capture nothing */ }

#define FORWARD(name, ...) \
    __typeof__(&name) fn = REAL(name); \
    if (!fn) return CUDA_ERROR_NOT_FOUND; \
    return fn(__VA_ARGS__)

static CUresult begin_v2(CUstream s, CUstreamCaptureMode mode) { FORWARD(cuStreamBeginCapture_v2, s, mode); }
static CUresult begin_v2_ptsz(CUstream s, CUstreamCaptureMode mode) { FORWARD(cuStreamBeginCapture_v2_ptsz, s, mode); }
static CUresult begin_v1(CUstream s) { FORWARD(cuStreamBeginCapture, s); }
static CUresult begin_v1_ptsz(CUstream s) { FORWARD(cuStreamBeginCapture_ptsz, s); }
static CUresult end(CUstream s, CUgraph *g) { FORWARD(cuStreamEndCapture, s, g); }
static CUresult end_ptsz(CUstream s, CUgraph *g) { FORWARD(cuStreamEndCapture_ptsz, s, g); }

VGPU_API CUresult CUDAAPI cuStreamBeginCapture_v2(CUstream s, CUstreamCaptureMode mode) { return begun(begin_v2(s, mode)); }
VGPU_API CUresult CUDAAPI cuStreamBeginCapture_v2_ptsz(CUstream s, CUstreamCaptureMode mode) {
    return begun(begin_v2_ptsz(s, mode));
}
VGPU_API CUresult CUDAAPI cuStreamBeginCapture(CUstream s) { return begun(begin_v1(s)); }
VGPU_API CUresult CUDAAPI cuStreamBeginCapture_ptsz(CUstream s) { return begun(begin_v1_ptsz(s)); }
VGPU_API CUresult CUDAAPI cuStreamEndCapture(CUstream s, CUgraph *g) { return ended(end(s, g)); }
VGPU_API CUresult CUDAAPI cuStreamEndCapture_ptsz(CUstream s, CUgraph *g) { return ended(end_ptsz(s, g)); }
