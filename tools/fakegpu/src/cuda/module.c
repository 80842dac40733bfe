/* Modules (per context) and libraries (context-independent, CUDA 12) accept any image; their
 * functions and kernels are named placeholders created on first lookup. A CUkernel is the same
 * object as its CUfunction, as the real driver lets a CUkernel be passed where a CUfunction is. The
 * name decides the simulated duration (docs/fakegpu.md): "sleep_us_<N>" runs N microseconds,
 * "wave_us_<N>" N microseconds per wave of blocks, anything else FG_DEFAULT_WAVE_US per wave. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

#define FG_DEFAULT_WAVE_US 100

struct CUmod_st {
    uint32_t magic;
    CUcontext ctx; /* NULL for a library */
    struct CUfunc_st *funcs;
};

struct CUlib_st {
    struct CUmod_st module;
};

/* Its duration follows from its name and grid, and the SMs it will run on (sched.c). */
struct fg_work fg_kernel_work(CUfunction f, const unsigned grid[3])
{
    if (f->fixed)
        return (struct fg_work){.ns = f->fixed_ns, .blocks = 0};
    return (struct fg_work){.ns = f->wave_ns, .blocks = (uint64_t)grid[0] * grid[1] * grid[2]};
}

static CUresult new_module(CUmodule *module, const void *image)
{
    struct CUctx_st *ctx;
    CUresult rc = fg_current_ctx(&ctx);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!module || !image)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUmod_st *m = calloc(1, sizeof *m);
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->magic = FG_MAGIC_MODULE;
    m->ctx = ctx;
    *module = m;
    return CUDA_SUCCESS;
}

FG_API CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    return new_module(module, image);
}

FG_API CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                   CUjit_option *options, void **optionValues)
{
    (void)numOptions;
    (void)options;
    (void)optionValues;
    return new_module(module, image);
}

FG_API CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    return new_module(module, fatCubin);
}

FG_API CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    if (!fname)
        return CUDA_ERROR_INVALID_VALUE;
    if (access(fname, R_OK) != 0)
        return CUDA_ERROR_FILE_NOT_FOUND;
    return new_module(module, fname);
}

static CUresult check_module(CUmodule m)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    return m && m->magic == FG_MAGIC_MODULE ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

FG_API CUresult cuModuleUnload(CUmodule hmod)
{
    CUresult rc = check_module(hmod);
    if (rc != CUDA_SUCCESS)
        return rc;
    pthread_mutex_lock(&fg_lock);
    hmod->magic = 0;
    for (struct CUfunc_st *f = hmod->funcs; f; f = f->next)
        f->magic = 0;
    pthread_mutex_unlock(&fg_lock);
    /* Functions stay allocated: graphs may still name them, and must see them as unloaded. */
    return CUDA_SUCCESS;
}

static void set_duration(struct CUfunc_st *f)
{
    unsigned long long n;
    char tail;
    f->wave_ns = FG_DEFAULT_WAVE_US * 1000ULL;
    if (sscanf(f->name, "sleep_us_%llu%c", &n, &tail) == 1) {
        f->fixed = 1;
        f->fixed_ns = n * 1000ULL;
    } else if (sscanf(f->name, "wave_us_%llu%c", &n, &tail) == 1) {
        f->wave_ns = n * 1000ULL;
    }
}

static CUresult get_function(CUmodule hmod, const char *name, CUfunction *hfunc)
{
    CUresult rc = check_module(hmod);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!hfunc || !name || !*name)
        return CUDA_ERROR_INVALID_VALUE;
    if (strlen(name) >= sizeof((struct CUfunc_st *)0)->name)
        return CUDA_ERROR_NOT_FOUND;
    pthread_mutex_lock(&fg_lock);
    struct CUfunc_st *f = hmod->funcs;
    while (f && strcmp(f->name, name) != 0)
        f = f->next;
    if (!f && (f = calloc(1, sizeof *f)) != NULL) {
        f->magic = FG_MAGIC_FUNC;
        f->mod = hmod;
        strcpy(f->name, name);
        set_duration(f);
        f->next = hmod->funcs;
        hmod->funcs = f;
    }
    pthread_mutex_unlock(&fg_lock);
    if (!f)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *hfunc = f;
    return CUDA_SUCCESS;
}

FG_API CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
    return get_function(hmod, name, hfunc);
}

FG_API CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                  void **jitOptionsValues, unsigned int numJitOptions, CUlibraryOption *libraryOptions,
                                  void **libraryOptionValues, unsigned int numLibraryOptions)
{
    (void)jitOptions;
    (void)jitOptionsValues;
    (void)numJitOptions;
    (void)libraryOptions;
    (void)libraryOptionValues;
    (void)numLibraryOptions;
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!library || !code)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUlib_st *lib = calloc(1, sizeof *lib);
    if (!lib)
        return CUDA_ERROR_OUT_OF_MEMORY;
    lib->module.magic = FG_MAGIC_MODULE;
    *library = lib;
    return CUDA_SUCCESS;
}

FG_API CUresult cuLibraryUnload(CUlibrary library)
{
    if (!library)
        return CUDA_ERROR_INVALID_HANDLE;
    return cuModuleUnload(&library->module);
}

FG_API CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name)
{
    CUfunction f;
    if (!library || !pKernel)
        return library ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_INVALID_HANDLE;
    CUresult rc = get_function(&library->module, name, &f);
    if (rc == CUDA_SUCCESS)
        *pKernel = (CUkernel)f;
    return rc;
}

FG_API CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel)
{
    CUfunction f = (CUfunction)kernel;
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pFunc)
        return CUDA_ERROR_INVALID_VALUE;
    if (!f || f->magic != FG_MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    *pFunc = f;
    return CUDA_SUCCESS;
}

FG_API CUresult cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc)
{
    struct CUctx_st *current;
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!hfunc || hfunc->magic != FG_MAGIC_FUNC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    /* A module's function belongs to its context's device; a library's to the current one. */
    CUcontext ctx = hfunc->mod->ctx;
    if (!ctx) {
        rc = fg_current_ctx(&current);
        if (rc != CUDA_SUCCESS)
            return rc;
        ctx = current;
    }
    const struct fg_gpu_spec *gpu = fg_spec(ctx->dev);
    switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
        *pi = 1024;
        break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS:
        *pi = 32;
        break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION:
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION:
        *pi = gpu->cc_major * 10 + gpu->cc_minor;
        break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        *pi = 49152;
        break;
    default:
        *pi = 0;
        break;
    }
    return CUDA_SUCCESS;
}
