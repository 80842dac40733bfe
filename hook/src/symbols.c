/* Interception: the table of symbols.h, real entry points, dlsym and cuGetProcAddress.
 *
 * Clients reach the driver three ways (docs/hook.md): linked symbols (our exports interpose),
 * dlsym on the libcuda handle (our dlsym returns the wrapper), and cuGetProcAddress(_v2) (reached
 * through either, it returns the wrapper whose ABI the version and flags select). dlvsym answers as
 * dlsym does. The hook's own calls go to the real library, resolved through the real dlsym on a
 * handle of that library. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
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
void *vgpu_real_fns[VGPU_SYM_COUNT]; /* symbols.h says how it is read */
static pthread_once_t resolved[3] = {PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT};

typedef void *(*dlvsym_fn)(void *, const char *, const char *);

/* The address of a defined symbol's default version in a loaded library, read from the library's
 * own dynamic symbol table (GNU or SysV hash) without asking the dynamic linker: the hook defines
 * both dlsym and dlvsym, and a program's references to either reach the hook's, so neither can be
 * asked for glibc's dlvsym. Used once, for glibc's dlvsym; everything else is asked of that. */
static void *elf_lookup(const char *library, const char *name) {
    void *handle = dlopen(library, RTLD_LAZY | RTLD_NOLOAD);
    struct link_map *map = NULL;
    if (!handle) return NULL;
    int found_map = dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map;
    dlclose(handle); /* RTLD_NOLOAD took one more reference; the library stays loaded */
    if (!found_map) return NULL;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const Elf32_Word *gnu = NULL, *sysv = NULL;
    const ElfW(Half) *versym = NULL;
    for (const ElfW(Dyn) *d = map->l_ld; d->d_tag != DT_NULL; d++) {
        /* glibc relocates these in place where .dynamic is writable (x86-64, aarch64), not where
         * it is read-only: an address below the load address is still relative. */
        ElfW(Addr) p = d->d_un.d_ptr < map->l_addr ? d->d_un.d_ptr + map->l_addr : d->d_un.d_ptr;
        switch (d->d_tag) {
        case DT_SYMTAB: symtab = (const ElfW(Sym) *)p; break;
        case DT_STRTAB: strtab = (const char *)p; break;
        case DT_GNU_HASH: gnu = (const Elf32_Word *)p; break;
        case DT_HASH: sysv = (const Elf32_Word *)p; break;
        case DT_VERSYM: versym = (const ElfW(Half) *)p; break;
        default: break;
        }
    }
    if (!symtab || !strtab) return NULL;
    /* Candidates: the GNU hash chain of the name, else every symbol of the SysV table. */
    uint32_t first = 0, count = 0, hash = 5381, symoffset = 0;
    const Elf32_Word *chain = NULL;
    if (gnu) {
        for (const unsigned char *c = (const unsigned char *)name; *c; c++) hash = hash * 33 + *c;
        uint32_t nbuckets = gnu[0], bloom_words = gnu[2];
        symoffset = gnu[1];
        const Elf32_Word *buckets = (const Elf32_Word *)((const ElfW(Addr) *)&gnu[4] + bloom_words);
        first = nbuckets ? buckets[hash % nbuckets] : 0;
        if (first < symoffset) return NULL;
        chain = buckets + nbuckets; /* chain[k] is symbol symoffset + k's */
        count = UINT32_MAX;
    } else if (sysv) {
        count = sysv[1];
    }
    for (uint32_t i = first; count; i++, count--) {
        const ElfW(Sym) *s = &symtab[i];
        if ((!chain || (chain[i - symoffset] | 1) == (hash | 1)) && s->st_shndx != SHN_UNDEF &&
            ELF64_ST_TYPE(s->st_info) == STT_FUNC /* ELF32_ST_TYPE is the same */ && !(versym && (versym[i] & 0x8000)) &&
            !strcmp(strtab + s->st_name, name))
            return (void *)(map->l_addr + s->st_value);
        if (chain && (chain[i - symoffset] & 1)) break; /* the last of this bucket */
    }
    return NULL;
}

static void resolve(enum vgpu_library lib) {
    /* The library is normally loaded already (the client called into it); load it otherwise. */
    void *handle = dlopen(library_names[lib], RTLD_NOW | RTLD_NOLOAD);
    if (!handle) handle = dlopen(library_names[lib], RTLD_NOW);
    if (!handle) return;
    for (int i = 0; i < VGPU_SYM_COUNT; i++)
        if (symbols[i].lib == lib) __atomic_store_n(&vgpu_real_fns[i], REAL(dlsym)(handle, symbols[i].abi), __ATOMIC_RELEASE);
}
static void resolve_cuda(void) { resolve(VGPU_LIB_CUDA); }
static void resolve_nvml(void) { resolve(VGPU_LIB_NVML); }

/* glibc's dlvsym (libdl's before glibc 2.34), and the next dlsym after the hook, asked of it by
 * version so that the hook's own is skipped (a versioned lookup never matches the hook's
 * unversioned definitions). RTLD_NEXT is "after the hook": the call comes from here. */
static void resolve_dl(void) {
    dlvsym_fn glibc = (dlvsym_fn)elf_lookup("libc.so.6", "dlvsym");
    if (!glibc) glibc = (dlvsym_fn)elf_lookup("libdl.so.2", "dlvsym");
    if (!glibc) return;
    __atomic_store_n(&vgpu_real_fns[VGPU_SYM_dlvsym], (void *)glibc, __ATOMIC_RELEASE);
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    void *next = NULL;
    for (size_t i = 0; !next && i < sizeof versions / sizeof *versions; i++) next = glibc(RTLD_NEXT, "dlsym", versions[i]);
    __atomic_store_n(&vgpu_real_fns[VGPU_SYM_dlsym], next, __ATOMIC_RELEASE);
}

static void (*const resolvers[])(void) = {
    [VGPU_LIB_CUDA] = resolve_cuda, [VGPU_LIB_NVML] = resolve_nvml, [VGPU_LIB_DL] = resolve_dl};

void *vgpu_real(int id) {
    enum vgpu_library lib = symbols[id].lib;
    pthread_once(&resolved[lib], resolvers[lib]);
    return __atomic_load_n(&vgpu_real_fns[id], __ATOMIC_ACQUIRE);
}

static const struct vgpu_symbol *intercepted_by_abi(const char *name) {
    if (!name || (name[0] != 'c' && name[0] != 'n' && name[0] != 'd')) return NULL;
    for (int i = 0; i < VGPU_SYM_COUNT; i++)
        if (symbols[i].wrapper && !strcmp(symbols[i].abi, name)) return &symbols[i];
    return NULL;
}

/* GCC makes the sibling calls below at -O2 only: keep dlsym and dlvsym optimised whatever CFLAGS say. */
#if defined(__GNUC__) && !defined(__clang__)
#define VGPU_SIBLING_CALLS __attribute__((optimize("O2")))
#else
#define VGPU_SIBLING_CALLS
#endif

/* dlsym and dlvsym answer alike: an intercepted name (a driver function, dlsym, dlvsym) gets the
 * hook's wrapper, on any handle, RTLD_NEXT included; any other name is glibc's answer. */
VGPU_SIBLING_CALLS VGPU_API void *dlsym(void *handle, const char *name) {
    void *(*glibc)(void *, const char *) = REAL(dlsym);
    if (!glibc) return NULL;
    const struct vgpu_symbol *s = intercepted_by_abi(name);
    if (handle == RTLD_NEXT) {
        if (s) return s->wrapper;
        /* RTLD_NEXT means "after the caller", which glibc finds from its return address: this must
         * stay a sibling call (a jump), so that glibc sees our caller's (tests/hook/test_interception.py). */
        return glibc(handle, name);
    }
    void *found = glibc(handle, name);
    if (!found) return NULL;
    return s ? s->wrapper : found;
}

VGPU_SIBLING_CALLS VGPU_API void *dlvsym(void *handle, const char *name, const char *version) {
    dlvsym_fn glibc = REAL(dlvsym);
    if (!glibc) return NULL;
    const struct vgpu_symbol *s = intercepted_by_abi(name);
    if (handle == RTLD_NEXT) {
        if (s) return s->wrapper;
        return glibc(handle, name, version); /* a sibling call, as in dlsym */
    }
    void *found = glibc(handle, name, version);
    if (!found) return NULL;
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
