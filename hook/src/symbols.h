/* THE table of intercepted symbols (every one, in one place), and the driver calls the hook makes.
 *
 * X(abi name, base name asked of cuGetProcAddress, first cudaVersion of this ABI, per-thread-stream
 *   variant, library). An intercepted symbol is exported under its ABI name (for programs linked with
 *   -lcuda / -lnvidia-ml), returned by dlsym in its place, and returned by cuGetProcAddress when the
 *   base name, version and flags select that ABI.
 *
 * The table names the wrappers (memory.c, nvml.c, compute.c, capture.c, mps.c, symbols.c) so that symbols.c can hand
 * them out, and the wrappers reach the driver through it (REAL): the one two-way link between the
 * hook's files, and the price of a single table that lists every intercepted symbol.
 *
 * dlsym and dlvsym (VGPU_LIB_DL) are in the table like the driver's functions: asked for by name
 * (dlsym(h, "dlvsym"), dlvsym(h, "dlsym", "GLIBC_2.34")), the hook's own is returned, so that no
 * lookup reaches glibc's and through it the driver's real functions. Their REAL ones are the next
 * definitions after the hook (symbols.c says how they are found). */
#ifndef VGPU_SYMBOLS_H
#define VGPU_SYMBOLS_H

#define VGPU_INTERCEPTED(X)                                                                      \
    X(cuGetProcAddress, "cuGetProcAddress", 11030, 0, VGPU_LIB_CUDA)                             \
    X(cuGetProcAddress_v2, "cuGetProcAddress", 12000, 0, VGPU_LIB_CUDA)                          \
    X(cuInit, "cuInit", 2000, 0, VGPU_LIB_CUDA)                                                  \
    X(cuMemAlloc_v2, "cuMemAlloc", 3020, 0, VGPU_LIB_CUDA)                                       \
    X(cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, 0, VGPU_LIB_CUDA)                             \
    X(cuMemFree_v2, "cuMemFree", 3020, 0, VGPU_LIB_CUDA)                                         \
    X(cuMemAllocManaged, "cuMemAllocManaged", 6000, 0, VGPU_LIB_CUDA)                            \
    X(cuMemAllocAsync, "cuMemAllocAsync", 11020, 0, VGPU_LIB_CUDA)                               \
    X(cuMemAllocAsync_ptsz, "cuMemAllocAsync", 11020, 1, VGPU_LIB_CUDA)                          \
    X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 11020, 0, VGPU_LIB_CUDA)               \
    X(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 11020, 1, VGPU_LIB_CUDA)          \
    X(cuMemFreeAsync, "cuMemFreeAsync", 11020, 0, VGPU_LIB_CUDA)                                 \
    X(cuMemFreeAsync_ptsz, "cuMemFreeAsync", 11020, 1, VGPU_LIB_CUDA)                            \
    X(cuMemCreate, "cuMemCreate", 10020, 0, VGPU_LIB_CUDA)                                       \
    X(cuMemRelease, "cuMemRelease", 10020, 0, VGPU_LIB_CUDA)                                     \
    X(cuArrayCreate_v2, "cuArrayCreate", 3020, 0, VGPU_LIB_CUDA)                                 \
    X(cuArray3DCreate_v2, "cuArray3DCreate", 3020, 0, VGPU_LIB_CUDA)                             \
    X(cuArrayDestroy, "cuArrayDestroy", 2000, 0, VGPU_LIB_CUDA)                                  \
    X(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", 5000, 0, VGPU_LIB_CUDA)                  \
    X(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 5000, 0, VGPU_LIB_CUDA)                \
    X(cuMemGetInfo_v2, "cuMemGetInfo", 3020, 0, VGPU_LIB_CUDA)                                   \
    X(cuDeviceTotalMem_v2, "cuDeviceTotalMem", 3020, 0, VGPU_LIB_CUDA)                           \
    X(cuCtxDestroy_v2, "cuCtxDestroy", 4000, 0, VGPU_LIB_CUDA)                                   \
    X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", 7000, 0, VGPU_LIB_CUDA)            \
    X(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", 11000, 0, VGPU_LIB_CUDA)        \
    X(cuDevicePrimaryCtxReset, "cuDevicePrimaryCtxReset", 7000, 0, VGPU_LIB_CUDA)                \
    X(cuDevicePrimaryCtxReset_v2, "cuDevicePrimaryCtxReset", 11000, 0, VGPU_LIB_CUDA)            \
    X(cuLaunchKernel, "cuLaunchKernel", 4000, 0, VGPU_LIB_CUDA)                                  \
    X(cuLaunchKernel_ptsz, "cuLaunchKernel", 7000, 1, VGPU_LIB_CUDA)                             \
    X(cuLaunchKernelEx, "cuLaunchKernelEx", 11060, 0, VGPU_LIB_CUDA)                             \
    X(cuLaunchKernelEx_ptsz, "cuLaunchKernelEx", 11060, 1, VGPU_LIB_CUDA)                        \
    X(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", 9000, 0, VGPU_LIB_CUDA)            \
    X(cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel", 9000, 1, VGPU_LIB_CUDA)       \
    X(cuGraphLaunch, "cuGraphLaunch", 10000, 0, VGPU_LIB_CUDA)                                   \
    X(cuGraphLaunch_ptsz, "cuGraphLaunch", 10000, 1, VGPU_LIB_CUDA)                              \
    X(cuStreamBeginCapture, "cuStreamBeginCapture", 10000, 0, VGPU_LIB_CUDA)                     \
    X(cuStreamBeginCapture_ptsz, "cuStreamBeginCapture", 10000, 1, VGPU_LIB_CUDA)                \
    X(cuStreamBeginCapture_v2, "cuStreamBeginCapture", 10010, 0, VGPU_LIB_CUDA)                  \
    X(cuStreamBeginCapture_v2_ptsz, "cuStreamBeginCapture", 10010, 1, VGPU_LIB_CUDA)             \
    X(cuStreamEndCapture, "cuStreamEndCapture", 10000, 0, VGPU_LIB_CUDA)                         \
    X(cuStreamEndCapture_ptsz, "cuStreamEndCapture", 10000, 1, VGPU_LIB_CUDA)                    \
    X(nvmlDeviceGetMemoryInfo, NULL, 0, 0, VGPU_LIB_NVML)                                        \
    X(nvmlDeviceGetMemoryInfo_v2, NULL, 0, 0, VGPU_LIB_NVML)                                     \
    X(dlsym, NULL, 0, 0, VGPU_LIB_DL)                                                            \
    X(dlvsym, NULL, 0, 0, VGPU_LIB_DL)

/* Driver functions the hook calls itself (never intercepted). */
#define VGPU_CALLED(Y)                                  \
    Y(cuDeviceGetCount, VGPU_LIB_CUDA)                  \
    Y(cuDeviceGet, VGPU_LIB_CUDA)                       \
    Y(cuDeviceGetUuid_v2, VGPU_LIB_CUDA)                \
    Y(cuCtxGetDevice, VGPU_LIB_CUDA)                    \
    Y(cuCtxGetCurrent, VGPU_LIB_CUDA)                   \
    Y(cuDevicePrimaryCtxRetain, VGPU_LIB_CUDA)          \
    Y(cuDevicePrimaryCtxGetState, VGPU_LIB_CUDA)        \
    Y(cuEventCreate, VGPU_LIB_CUDA)                     \
    Y(cuEventRecord, VGPU_LIB_CUDA)                     \
    Y(cuEventQuery, VGPU_LIB_CUDA)                      \
    Y(cuEventSynchronize, VGPU_LIB_CUDA)                \
    Y(cuEventElapsedTime_v2, VGPU_LIB_CUDA)             \
    Y(cuEventDestroy_v2, VGPU_LIB_CUDA)                 \
    Y(cuStreamIsCapturing, VGPU_LIB_CUDA)               \
    Y(nvmlInit_v2, VGPU_LIB_NVML)                       \
    Y(nvmlDeviceGetUUID, VGPU_LIB_NVML)                 \
    Y(nvmlDeviceGetHandleByUUID, VGPU_LIB_NVML)         \
    Y(nvmlDeviceGetUtilizationRates, VGPU_LIB_NVML)

enum vgpu_symbol_id {
#define VGPU_ID_X(abi, base, version, ptsz, lib) VGPU_SYM_##abi,
#define VGPU_ID_Y(abi, lib) VGPU_SYM_##abi,
    VGPU_INTERCEPTED(VGPU_ID_X) VGPU_CALLED(VGPU_ID_Y) VGPU_SYM_COUNT
#undef VGPU_ID_X
#undef VGPU_ID_Y
};

/* The real entry points, by symbol id: NULL until resolved (or when the library lacks one). */
void *vgpu_real(int symbol); /* also in vgpu.h: resolves the symbol's library once */
extern void *vgpu_real_fns[VGPU_SYM_COUNT];

/* Every wrapper asks for its real function on every call, so the answer is one load once the
 * library is resolved: resolve() stores each pointer (release) once the library is open, and a
 * thread that loads a non-NULL pointer (acquire) may call it. Only a NULL takes vgpu_real's
 * once-only resolution (symbols.c), which answers NULL again for a symbol the library lacks. */
static inline void *vgpu_real_fast(int id) {
    void *fn = __atomic_load_n(&vgpu_real_fns[id], __ATOMIC_ACQUIRE);
    return fn ? fn : vgpu_real(id);
}

/* The real driver's function behind `name`, typed like the hook's declaration of `name`. */
#define REAL(name) ((__typeof__(&name))vgpu_real_fast(VGPU_SYM_##name))
/* The same, NULL while not resolved yet (no call: for wrappers whose fast path must make none). */
#define REAL_IF_RESOLVED(name) ((__typeof__(&name))__atomic_load_n(&vgpu_real_fns[VGPU_SYM_##name], __ATOMIC_ACQUIRE))

#endif
