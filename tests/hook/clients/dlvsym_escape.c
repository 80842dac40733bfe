/* Tries every way through dlvsym (and dlsym asked for dlvsym) to reach glibc's own dlsym or the
 * driver's own cuMemAlloc_v2, around the hook. For each attempt it prints one line:
 *   <attempt> <what the lookup returned> <quota>
 * where what it returned is "hook" (the function this program's own dlsym / dlvsym / cuMemAlloc_v2
 * references are bound to: the hook's when it is preloaded), "other" or "absent", and quota is
 * "held" when, through what it got, a second allocation of 768 MiB failed with out of memory
 * (the test runs it with a 1 GiB quota), "escaped" when it succeeded, "-" when nothing was got.
 * Built with -ldl only: it reaches libcuda.so.1 by dlopen. */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef void *(*dlsym_fn)(void *, const char *);
typedef void *(*dlvsym_fn)(void *, const char *, const char *);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);

static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
static void *cuda;
static void *hooks_alloc;
static free_fn free_memory;

static const char *quota_through(alloc_fn alloc) {
    if (!alloc) return "-";
    CUdeviceptr first = 0, second = 0;
    if (alloc(&first, 768u << 20) != CUDA_SUCCESS) return "first-failed";
    CUresult r = alloc(&second, 768u << 20);
    free_memory(first);
    if (r == CUDA_SUCCESS) free_memory(second);
    return r == CUDA_ERROR_OUT_OF_MEMORY ? "held" : r == CUDA_SUCCESS ? "escaped" : "error";
}

static void report(const char *attempt, void *got, void *hooks, alloc_fn alloc) {
    printf("%s %s %s\n", attempt, !got ? "absent" : got == hooks ? "hook" : "other", quota_through(alloc));
}

/* A dlsym got through dlvsym: is it the hook's, and does the quota hold through what it finds? */
static void try_dlsym(const char *attempt, void *handle) {
    void *got = NULL;
    for (size_t i = 0; !got && i < sizeof versions / sizeof *versions; i++)
        got = dlvsym(handle, "dlsym", versions[i]);
    report(attempt, got, (void *)dlsym, got ? (alloc_fn)((dlsym_fn)got)(cuda, "cuMemAlloc_v2") : NULL);
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    cuda = dlopen("libcuda.so.1", RTLD_NOW);
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    if (!cuda || !libc) {
        printf("fatal dlopen\n");
        return 1;
    }
    CUresult (*init)(unsigned) = (CUresult(*)(unsigned))dlsym(cuda, "cuInit");
    CUresult (*get)(CUdevice *, int) = (CUresult(*)(CUdevice *, int))dlsym(cuda, "cuDeviceGet");
    CUresult (*retain)(CUcontext *, CUdevice) = (CUresult(*)(CUcontext *, CUdevice))dlsym(cuda, "cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = (CUresult(*)(CUcontext))dlsym(cuda, "cuCtxSetCurrent");
    free_memory = (free_fn)dlsym(cuda, "cuMemFree_v2");
    hooks_alloc = dlsym(cuda, "cuMemAlloc_v2");
    CUdevice device;
    CUcontext ctx;
    if (!init || !get || !retain || !set || !free_memory || !hooks_alloc || init(0) || get(&device, 0) ||
        retain(&ctx, device) || set(ctx)) {
        printf("fatal cuda\n");
        return 1;
    }
    report("dlsym-handle", hooks_alloc, hooks_alloc, (alloc_fn)hooks_alloc); /* the control */

    try_dlsym("dlvsym-next-dlsym", RTLD_NEXT);
    try_dlsym("dlvsym-default-dlsym", RTLD_DEFAULT);
    try_dlsym("dlvsym-libc-dlsym", libc);

    void *got = dlvsym(RTLD_NEXT, "cuMemAlloc_v2", "libcuda.so.1");
    report("dlvsym-next-alloc", got, hooks_alloc, (alloc_fn)got);
    got = NULL;
    for (size_t i = 0; !got && i < sizeof versions / sizeof *versions; i++)
        got = dlvsym(cuda, "cuMemAlloc_v2", versions[i]);
    report("dlvsym-handle-alloc", got, hooks_alloc, (alloc_fn)got);

    /* dlsym asked for dlvsym, then that asked for glibc's dlsym. */
    dlvsym_fn through[] = {(dlvsym_fn)dlsym(libc, "dlvsym"), (dlvsym_fn)dlsym(RTLD_NEXT, "dlvsym")};
    const char *names[] = {"dlsym-libc-dlvsym", "dlsym-next-dlvsym"};
    for (int k = 0; k < 2; k++) {
        void *inner = NULL;
        for (size_t i = 0; through[k] && !inner && i < sizeof versions / sizeof *versions; i++)
            inner = through[k](libc, "dlsym", versions[i]);
        report(names[k], (void *)through[k], (void *)dlvsym,
               inner ? (alloc_fn)((dlsym_fn)inner)(cuda, "cuMemAlloc_v2") : NULL);
    }
    return 0;
}
