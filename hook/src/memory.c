/* Memory quota: every way to get device memory reserves quota in the region before the driver is
 * asked, and gives it back if the driver fails, so a refused allocation leaves nothing behind and
 * concurrent allocations can never overshoot. Frees give back what tracking.c recorded. */
#include "symbols.h"
#include "vgpu.h"
#include "wrappers.h"

#define PITCH_ALIGNMENT 512

/* The driver refused `call` for lack of memory on a GPU whose memory best-effort neighbours borrow:
 * wait for the node agent to evict them and ask again (shortfall.c). A successful call pays one
 * compare. The region reservation (bytes on d) is held meanwhile. */
#define AWAIT_MEMORY(r, d, bytes, call)                                                          \
    do {                                                                                         \
        if (__builtin_expect((r) == CUDA_ERROR_OUT_OF_MEMORY, 0) && vgpu_shortfall_wait_ms(d)) { \
            struct vgpu_shortfall wait_ = vgpu_shortfall_begin((d), (bytes));                    \
            while ((r) == CUDA_ERROR_OUT_OF_MEMORY && vgpu_shortfall_pause(&wait_)) (r) = (call); \
            vgpu_shortfall_end(&wait_, (r));                                                     \
        }                                                                                        \
    } while (0)

static CUcontext current_context(void) {
    CUcontext ctx = NULL;
    if (REAL(cuCtxGetCurrent)) REAL(cuCtxGetCurrent)(&ctx);
    return ctx;
}

/* Reserves bytes on the GPU of the current context (or of `cu` when >= 0); *ctx is the current
 * context, which the allocation will belong to. */
static CUresult reserve(int cu, uint64_t bytes, const struct vgpu_device **out, CUcontext *ctx) {
    CUresult err = CUDA_SUCCESS;
    const struct vgpu_device *d = cu >= 0 ? vgpu_device_of((CUdevice)cu, &err) : vgpu_device_current(ctx, &err);
    if (!d) return err;
    if (cu >= 0) *ctx = current_context();
    if (vgpu_region_reserve(d->rdev, bytes, vgpu_memory_quota(d)) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    *out = d;
    return CUDA_SUCCESS;
}

/* Records a successful allocation; if it cannot be recorded, undoes it (fail closed). */
static CUresult record(CUresult r, CUcontext ctx, enum vgpu_kind kind, uint64_t key, const struct vgpu_device *d,
                       uint64_t bytes, CUresult (*undo)(uint64_t)) {
    if (r != CUDA_SUCCESS) {
        vgpu_region_release(d->rdev, bytes);
        return r;
    }
    if (vgpu_track_add(kind, key, d->rdev, bytes, ctx) == 0) return r;
    vgpu_log("cannot record an allocation of %llu bytes; refusing it", (unsigned long long)bytes);
    undo(key);
    vgpu_region_release(d->rdev, bytes);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* Forgets key and frees it; restores the record if the driver refused to free. Inlined into each
 * free wrapper, so that free_fn is a direct call (cuMemFree_v2 runs on every free). */
__attribute__((always_inline)) static inline CUresult forget(enum vgpu_kind kind, uint64_t key, CUresult (*free_fn)(uint64_t)) {
    int rdev;
    uint64_t bytes;
    if (!vgpu_track_take(kind, key, &rdev, &bytes)) return free_fn(key); /* not ours to count */
    CUresult r = free_fn(key);
    if (r == CUDA_SUCCESS) vgpu_region_release(rdev, bytes);
    else vgpu_track_add(kind, key, rdev, bytes, current_context());
    return r;
}

static CUresult free_pointer(uint64_t p) { return REAL(cuMemFree_v2)((CUdeviceptr)p); }
static CUresult release_handle(uint64_t h) { return REAL(cuMemRelease)((CUmemGenericAllocationHandle)h); }
static CUresult destroy_array(uint64_t a) { return REAL(cuArrayDestroy)((CUarray)(uintptr_t)a); }
static CUresult destroy_mipmap(uint64_t m) {
    return REAL(cuMipmappedArrayDestroy)((CUmipmappedArray)(uintptr_t)m);
}

#define REQUIRE(name)                                  \
    do {                                               \
        if (!REAL(name)) return CUDA_ERROR_NOT_FOUND;  \
    } while (0)

VGPU_API CUresult CUDAAPI cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    __typeof__(&cuMemAlloc_v2) fn = REAL(cuMemAlloc_v2);
    if (!fn) return CUDA_ERROR_NOT_FOUND;
    const struct vgpu_device *d = NULL;
    CUcontext ctx = NULL;
    CUresult r = reserve(-1, bytes, &d, &ctx);
    if (r != CUDA_SUCCESS) return r;
    r = fn(dptr, bytes);
    AWAIT_MEMORY(r, d, bytes, fn(dptr, bytes));
    return record(r, ctx, VGPU_KIND_POINTER, r == CUDA_SUCCESS ? *dptr : 0, d, bytes, free_pointer);
}

VGPU_API CUresult CUDAAPI cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags) {
    REQUIRE(cuMemAllocManaged);
    const struct vgpu_device *d = NULL;
    CUcontext ctx = NULL;
    CUresult r = reserve(-1, bytes, &d, &ctx);
    if (r != CUDA_SUCCESS) return r;
    r = REAL(cuMemAllocManaged)(dptr, bytes, flags);
    AWAIT_MEMORY(r, d, bytes, REAL(cuMemAllocManaged)(dptr, bytes, flags));
    return record(r, ctx, VGPU_KIND_POINTER, r == CUDA_SUCCESS ? *dptr : 0, d, bytes, free_pointer);
}

VGPU_API CUresult CUDAAPI cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                             unsigned int element_bytes) {
    REQUIRE(cuMemAllocPitch_v2);
    const struct vgpu_device *d = NULL;
    CUcontext ctx = NULL;
    uint64_t rounded = (width + PITCH_ALIGNMENT - 1) / PITCH_ALIGNMENT * PITCH_ALIGNMENT;
    if (height && rounded > UINT64_MAX / height) return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t bytes = rounded * height;
    CUresult r = reserve(-1, bytes, &d, &ctx);
    if (r != CUDA_SUCCESS) return r;
    r = REAL(cuMemAllocPitch_v2)(dptr, pitch, width, height, element_bytes);
    AWAIT_MEMORY(r, d, bytes, REAL(cuMemAllocPitch_v2)(dptr, pitch, width, height, element_bytes));
    if (r == CUDA_SUCCESS) {
        /* Settle the reservation on the pitch the driver chose. */
        uint64_t actual = (uint64_t)*pitch * height;
        if (actual > bytes && vgpu_region_reserve(d->rdev, actual - bytes, vgpu_memory_quota(d)) != 0) {
            REAL(cuMemFree_v2)(*dptr);
            vgpu_region_release(d->rdev, bytes);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        if (actual < bytes) vgpu_region_release(d->rdev, bytes - actual);
        bytes = actual;
    }
    return record(r, ctx, VGPU_KIND_POINTER, r == CUDA_SUCCESS ? *dptr : 0, d, bytes, free_pointer);
}

VGPU_API CUresult CUDAAPI cuMemFree_v2(CUdeviceptr dptr) {
    REQUIRE(cuMemFree_v2);
    return forget(VGPU_KIND_POINTER, dptr, free_pointer);
}

static CUresult alloc_async(CUresult (*fn)(CUdeviceptr *, size_t, CUstream), CUdeviceptr *dptr, size_t bytes,
                            CUstream stream) {
    if (!fn) return CUDA_ERROR_NOT_FOUND;
    const struct vgpu_device *d = NULL;
    CUcontext ctx = NULL;
    CUresult r = reserve(-1, bytes, &d, &ctx);
    if (r != CUDA_SUCCESS) return r;
    r = fn(dptr, bytes, stream);
    AWAIT_MEMORY(r, d, bytes, fn(dptr, bytes, stream));
    return record(r, ctx, VGPU_KIND_POINTER, r == CUDA_SUCCESS ? *dptr : 0, d, bytes, free_pointer);
}

VGPU_API CUresult CUDAAPI cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream stream) {
    return alloc_async(REAL(cuMemAllocAsync), dptr, bytes, stream);
}

VGPU_API CUresult CUDAAPI cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream stream) {
    return alloc_async(REAL(cuMemAllocAsync_ptsz), dptr, bytes, stream);
}

static CUresult alloc_from_pool(CUresult (*fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream), CUdeviceptr *dptr,
                                size_t bytes, CUmemoryPool pool, CUstream stream) {
    if (!fn) return CUDA_ERROR_NOT_FOUND;
    const struct vgpu_device *d = NULL;
    CUcontext ctx = NULL;
    CUresult r = reserve(-1, bytes, &d, &ctx);
    if (r != CUDA_SUCCESS) return r;
    r = fn(dptr, bytes, pool, stream);
    AWAIT_MEMORY(r, d, bytes, fn(dptr, bytes, pool, stream));
    return record(r, ctx, VGPU_KIND_POINTER, r == CUDA_SUCCESS ? *dptr : 0, d, bytes, free_pointer);
}

VGPU_API CUresult CUDAAPI cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                                                  CUstream stream) {
    return alloc_from_pool(REAL(cuMemAllocFromPoolAsync), dptr, bytes, pool, stream);
}

VGPU_API CUresult CUDAAPI cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                                                       CUstream stream) {
    return alloc_from_pool(REAL(cuMemAllocFromPoolAsync_ptsz), dptr, bytes, pool, stream);
}

/* The quota returns when the free is queued: the driver reuses the memory in stream order. */
static CUresult free_async(CUresult (*fn)(CUdeviceptr, CUstream), CUdeviceptr dptr, CUstream stream) {
    if (!fn) return CUDA_ERROR_NOT_FOUND;
    int rdev;
    uint64_t bytes;
    int tracked = vgpu_track_take(VGPU_KIND_POINTER, dptr, &rdev, &bytes);
    CUresult r = fn(dptr, stream);
    if (tracked && r == CUDA_SUCCESS) vgpu_region_release(rdev, bytes);
    else if (tracked) vgpu_track_add(VGPU_KIND_POINTER, dptr, rdev, bytes, current_context());
    return r;
}

VGPU_API CUresult CUDAAPI cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    return free_async(REAL(cuMemFreeAsync), dptr, stream);
}

VGPU_API CUresult CUDAAPI cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream) {
    return free_async(REAL(cuMemFreeAsync_ptsz), dptr, stream);
}

VGPU_API CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                      const CUmemAllocationProp *prop, unsigned long long flags) {
    REQUIRE(cuMemCreate);
    /* Host-located physical memory (CU_MEM_LOCATION_TYPE_HOST...) is not device memory. */
    if (!prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return REAL(cuMemCreate)(handle, size, prop, flags);
    const struct vgpu_device *d = NULL;
    CUcontext ctx = NULL;
    CUresult r = reserve(prop->location.id, size, &d, &ctx);
    if (r != CUDA_SUCCESS) return r;
    r = REAL(cuMemCreate)(handle, size, prop, flags);
    AWAIT_MEMORY(r, d, size, REAL(cuMemCreate)(handle, size, prop, flags));
    return record(r, ctx, VGPU_KIND_HANDLE, r == CUDA_SUCCESS ? *handle : 0, d, size, release_handle);
}

VGPU_API CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
    REQUIRE(cuMemRelease);
    return forget(VGPU_KIND_HANDLE, handle, release_handle);
}

/* Bytes per channel element of an array format; formats not listed count 16 (never too few). */
static uint64_t format_bytes(CUarray_format format) {
    switch (format) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT: return 4;
    default: return 16;
    }
}

static uint64_t at_least_1(size_t n) { return n ? n : 1; }

static uint64_t array_bytes(size_t w, size_t h, size_t depth, unsigned channels, CUarray_format format) {
    return (uint64_t)at_least_1(w) * at_least_1(h) * at_least_1(depth) * at_least_1(channels) * format_bytes(format);
}

VGPU_API CUresult CUDAAPI cuArrayCreate_v2(CUarray *array, const CUDA_ARRAY_DESCRIPTOR *desc) {
    REQUIRE(cuArrayCreate_v2);
    if (!desc) return REAL(cuArrayCreate_v2)(array, desc);
    uint64_t bytes = array_bytes(desc->Width, desc->Height, 1, desc->NumChannels, desc->Format);
    const struct vgpu_device *d = NULL;
    CUcontext ctx = NULL;
    CUresult r = reserve(-1, bytes, &d, &ctx);
    if (r != CUDA_SUCCESS) return r;
    r = REAL(cuArrayCreate_v2)(array, desc);
    AWAIT_MEMORY(r, d, bytes, REAL(cuArrayCreate_v2)(array, desc));
    return record(r, ctx, VGPU_KIND_ARRAY, r == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*array : 0, d, bytes,
                  destroy_array);
}

VGPU_API CUresult CUDAAPI cuArray3DCreate_v2(CUarray *array, const CUDA_ARRAY3D_DESCRIPTOR *desc) {
    REQUIRE(cuArray3DCreate_v2);
    if (!desc) return REAL(cuArray3DCreate_v2)(array, desc);
    uint64_t bytes = array_bytes(desc->Width, desc->Height, desc->Depth, desc->NumChannels, desc->Format);
    const struct vgpu_device *d = NULL;
    CUcontext ctx = NULL;
    CUresult r = reserve(-1, bytes, &d, &ctx);
    if (r != CUDA_SUCCESS) return r;
    r = REAL(cuArray3DCreate_v2)(array, desc);
    AWAIT_MEMORY(r, d, bytes, REAL(cuArray3DCreate_v2)(array, desc));
    return record(r, ctx, VGPU_KIND_ARRAY, r == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*array : 0, d, bytes,
                  destroy_array);
}

VGPU_API CUresult CUDAAPI cuArrayDestroy(CUarray array) {
    REQUIRE(cuArrayDestroy);
    return forget(VGPU_KIND_ARRAY, (uint64_t)(uintptr_t)array, destroy_array);
}

VGPU_API CUresult CUDAAPI cuMipmappedArrayCreate(CUmipmappedArray *mipmap, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                                 unsigned int levels) {
    REQUIRE(cuMipmappedArrayCreate);
    if (!desc) return REAL(cuMipmappedArrayCreate)(mipmap, desc, levels);
    uint64_t bytes = 0;
    for (unsigned l = 0; l < levels && l < 64; l++)
        bytes += array_bytes(desc->Width >> l, desc->Height >> l, desc->Depth >> l, desc->NumChannels, desc->Format);
    const struct vgpu_device *d = NULL;
    CUcontext ctx = NULL;
    CUresult r = reserve(-1, bytes, &d, &ctx);
    if (r != CUDA_SUCCESS) return r;
    r = REAL(cuMipmappedArrayCreate)(mipmap, desc, levels);
    AWAIT_MEMORY(r, d, bytes, REAL(cuMipmappedArrayCreate)(mipmap, desc, levels));
    return record(r, ctx, VGPU_KIND_MIPMAP, r == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*mipmap : 0, d, bytes,
                  destroy_mipmap);
}

VGPU_API CUresult CUDAAPI cuMipmappedArrayDestroy(CUmipmappedArray mipmap) {
    REQUIRE(cuMipmappedArrayDestroy);
    return forget(VGPU_KIND_MIPMAP, (uint64_t)(uintptr_t)mipmap, destroy_mipmap);
}

VGPU_API CUresult CUDAAPI cuCtxDestroy_v2(CUcontext ctx) {
    REQUIRE(cuCtxDestroy_v2);
    CUresult r = REAL(cuCtxDestroy_v2)(ctx);
    if (r == CUDA_SUCCESS) {
        vgpu_device_contexts_ended();
        vgpu_compute_context_ended(ctx);
        vgpu_track_drop_context(ctx); /* the driver freed its allocations */
    }
    return r;
}

/* A primary context takes its allocations with it when it is reset, or released by its last user. */
static CUresult primary_context_ends(CUresult (*fn)(CUdevice), CUdevice dev, int reset) {
    if (!fn) return CUDA_ERROR_NOT_FOUND;
    unsigned flags;
    int active = 0;
    CUcontext primary = NULL;
    if (REAL(cuDevicePrimaryCtxGetState) && REAL(cuDevicePrimaryCtxRetain) && REAL(cuDevicePrimaryCtxRelease_v2) &&
        REAL(cuDevicePrimaryCtxGetState)(dev, &flags, &active) == CUDA_SUCCESS && active &&
        REAL(cuDevicePrimaryCtxRetain)(&primary, dev) == CUDA_SUCCESS)
        REAL(cuDevicePrimaryCtxRelease_v2)(dev); /* retained only to learn its handle */
    CUresult r = fn(dev);
    if (r == CUDA_SUCCESS) vgpu_device_contexts_ended();
    if (r == CUDA_SUCCESS && primary &&
        (reset || REAL(cuDevicePrimaryCtxGetState)(dev, &flags, &active) != CUDA_SUCCESS || !active)) {
        vgpu_compute_context_ended(primary);
        vgpu_track_drop_context(primary);
    }
    return r;
}

VGPU_API CUresult CUDAAPI cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    return primary_context_ends(REAL(cuDevicePrimaryCtxRelease_v2), dev, 0);
}

VGPU_API CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) {
    return primary_context_ends(REAL(cuDevicePrimaryCtxRelease), dev, 0);
}

VGPU_API CUresult CUDAAPI cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    return primary_context_ends(REAL(cuDevicePrimaryCtxReset_v2), dev, 1);
}

VGPU_API CUresult CUDAAPI cuDevicePrimaryCtxReset(CUdevice dev) {
    return primary_context_ends(REAL(cuDevicePrimaryCtxReset), dev, 1);
}

/* The quota is the GPU's size inside the container. */
VGPU_API CUresult CUDAAPI cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    REQUIRE(cuMemGetInfo_v2);
    CUresult r = REAL(cuMemGetInfo_v2)(free_bytes, total_bytes);
    if (r != CUDA_SUCCESS) return r;
    CUresult err;
    const struct vgpu_device *d = vgpu_device_current(NULL, &err);
    uint64_t quota = d ? vgpu_memory_quota(d) : 0;
    if (!d || quota == VGPU_UNLIMITED) return d ? r : err;
    uint64_t used = vgpu_region_used(d->rdev);
    uint64_t left = used < quota ? quota - used : 0;
    if (total_bytes) *total_bytes = quota;
    if (free_bytes && left < *free_bytes) *free_bytes = left;
    return r;
}

VGPU_API CUresult CUDAAPI cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    REQUIRE(cuDeviceTotalMem_v2);
    CUresult r = REAL(cuDeviceTotalMem_v2)(bytes, dev);
    if (r != CUDA_SUCCESS || !bytes) return r;
    CUresult err;
    const struct vgpu_device *d = vgpu_device_of(dev, &err);
    if (!d) return err;
    uint64_t quota = vgpu_memory_quota(d);
    if (quota < *bytes) *bytes = quota;
    return r;
}
