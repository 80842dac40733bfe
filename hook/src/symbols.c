/* Interception: the table of symbols.h, real entry points, dlsym and cuGetProcAddress.
 *
 * Clients reach the driver three ways (docs/hook.md): linked symbols (our exports interpose),
 * dlsym on the libcuda handle (our dlsym returns the wrapper), and cuGetProcAddress(_v2) (reached
 * through either, it returns the wrapper whose ABI the version and flags select). The hook's own
 * calls go to the real library, resolved through the real dlsym on a handle of that library. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

#include "symbols.h"
#include "vgpu.h"
#include "wrappers.h"

struct vgpu_symbol {
    const char *abi;
    const char *base;
    int version;
    int ptsz;
    enum vgpu_library lib;
    void *wrapper; /* NULL for the functions the hook only calls */
};

static const struct vgpu_symbol symbols[VGPU_SYM_COUNT] = {
#define VGPU_TABLE_X(abi, base, version, ptsz, lib) {#abi, base, version, ptsz, lib, (void *)abi},
#define VGPU_TABLE_Y(abi, lib) {#abi, NULL, 0, 0, lib, NULL},
    VGPU_INTERCEPTED(VGPU_TABLE_X) VGPU_CALLED(VGPU_TABLE_Y)
#undef VGPU_TABLE_X
#undef VGPU_TABLE_Y
};

static const char *const library_names[] = {[VGPU_LIB_CUDA] = "libcuda.so.1", [VGPU_LIB_NVML] = "libnvidia-ml.so.1"};
static void *real[VGPU_SYM_COUNT];
static pthread_once_t resolved[2] = {PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT};

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn next_dlsym;

/* glibc's own dlsym, found by version so that our override is skipped. */
static dlsym_fn glibc_dlsym(void) {
    dlsym_fn fn = __atomic_load_n(&next_dlsym, __ATOMIC_ACQUIRE);
    if (!fn) {
        static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
        for (size_t i = 0; !fn && i < sizeof versions / sizeof *versions; i++)
            fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
        /* Racing threads all store the same pointer. */
        __atomic_store_n(&next_dlsym, fn, __ATOMIC_RELEASE);
    }
    return fn;
}

static void *real_dlsym(void *handle, const char *name) {
    dlsym_fn fn = glibc_dlsym();
    return fn ? fn(handle, name) : NULL;
}

static void resolve(enum vgpu_library lib) {
    /* The library is normally loaded already (the client called into it); load it otherwise. */
    void *handle = dlopen(library_names[lib], RTLD_NOW | RTLD_NOLOAD);
    if (!handle) handle = dlopen(library_names[lib], RTLD_NOW);
    if (!handle) return;
    for (int i = 0; i < VGPU_SYM_COUNT; i++)
        if (symbols[i].lib == lib) real[i] = real_dlsym(handle, symbols[i].abi);
}
static void resolve_cuda(void) { resolve(VGPU_LIB_CUDA); }
static void resolve_nvml(void) { resolve(VGPU_LIB_NVML); }

void *vgpu_real(int id) {
    if (symbols[id].lib == VGPU_LIB_CUDA) pthread_once(&resolved[VGPU_LIB_CUDA], resolve_cuda);
    else pthread_once(&resolved[VGPU_LIB_NVML], resolve_nvml);
    return real[id];
}

static const struct vgpu_symbol *intercepted_by_abi(const char *name) {
    if (!name || (name[0] != 'c' && name[0] != 'n')) return NULL;
    for (int i = 0; i < VGPU_SYM_COUNT; i++)
        if (symbols[i].wrapper && !strcmp(symbols[i].abi, name)) return &symbols[i];
    return NULL;
}

/* GCC makes the sibling call below at -O2 only: keep dlsym optimised whatever CFLAGS say. */
#if defined(__GNUC__) && !defined(__clang__)
#define VGPU_SIBLING_CALLS __attribute__((optimize("O2")))
#else
#define VGPU_SIBLING_CALLS
#endif

VGPU_SIBLING_CALLS VGPU_API void *dlsym(void *handle, const char *name) {
    dlsym_fn glibc = glibc_dlsym();
    if (!glibc) return NULL;
    /* RTLD_NEXT means "after the caller", which glibc finds from its return address: this must stay
     * a sibling call (a jump), so that glibc sees our caller's (tests/hook/test_interception.py). */
    if (handle == RTLD_NEXT) return glibc(handle, name);
    void *found = glibc(handle, name);
    if (!found) return NULL;
    const struct vgpu_symbol *s = intercepted_by_abi(name);
    return s ? s->wrapper : found;
}

/* The wrapper cuGetProcAddress must hand out for (base, version, flags): the newest ABI not newer
 * than `version`, the per-thread-stream one if asked for and one exists. `*refuse` is set when
 * the base name is ours but older than every ABI the hook wraps (e.g. 32-bit cuMemAlloc). */
static void *wrapper_for(const char *base, int version, cuuint64_t flags, int *refuse) {
    int want_ptsz = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const struct vgpu_symbol *best = NULL, *best_legacy = NULL;
    int known = 0;
    for (int i = 0; i < VGPU_SYM_COUNT; i++) {
        const struct vgpu_symbol *s = &symbols[i];
        if (!s->wrapper || !s->base || strcmp(s->base, base)) continue;
        known = 1;
        if (s->version > version) continue;
        const struct vgpu_symbol **slot = s->ptsz ? &best : &best_legacy;
        if (!*slot || s->version > (*slot)->version) *slot = s;
    }
    if (!want_ptsz || !best) best = best_legacy;
    *refuse = known && !best;
    return best ? best->wrapper : NULL;
}

static CUresult wrap_result(CUresult r, const char *symbol, void **pfn, int version, cuuint64_t flags,
                            CUdriverProcAddressQueryResult *status) {
    if (r != CUDA_SUCCESS || !symbol || !pfn || !*pfn) return r;
    int refuse = 0;
    void *wrapper = wrapper_for(symbol, version, flags, &refuse);
    if (wrapper) *pfn = wrapper;
    if (refuse) {
        /* Fail closed: an ABI the hook cannot account must not reach the driver. */
        *pfn = NULL;
        if (status) *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
        return CUDA_ERROR_NOT_FOUND;
    }
    return r;
}

VGPU_API CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                              CUdriverProcAddressQueryResult *status) {
    if (!REAL(cuGetProcAddress_v2)) return CUDA_ERROR_NOT_FOUND;
    CUresult r = REAL(cuGetProcAddress_v2)(symbol, pfn, version, flags, status);
    return wrap_result(r, symbol, pfn, version, flags, status);
}

VGPU_API CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    if (!REAL(cuGetProcAddress)) return CUDA_ERROR_NOT_FOUND;
    CUresult r = REAL(cuGetProcAddress)(symbol, pfn, version, flags);
    return wrap_result(r, symbol, pfn, version, flags, NULL);
}
