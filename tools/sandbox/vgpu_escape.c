/* vgpu-escape: a tenant trying to get around its GPU memory quota, from inside its container.
 *
 * Each mode is one escape of docs/security.md; it prints one line per attempt:
 *   <attempt> <what it found> <blocks>
 * where blocks is how many 256 MiB blocks it got through what it found before the driver refused
 * one (at most MAX_BLOCKS; "-" when it got nothing to allocate with), and what it found says whose
 * function it was ("hook": the one this program's own references are bound to, the hook's when it
 * is preloaded; "driver": the driver's own; "other"; "absent") or, for a file, what opening it did.
 * Under a quota of Q MiB an escape held when blocks is Q / 256, and escaped when it is more.
 *
 *   vgpu-escape blocks [hold]       the quota through an ordinary dlopen of libcuda.so.1
 *   vgpu-escape preload             blocks again with LD_PRELOAD unset and pointing elsewhere
 *   vgpu-escape write               open for writing what the node agent mounted read-only
 *   vgpu-escape routes              dlvsym (to glibc's dlsym or the driver's cuMemAlloc_v2), a
 *                                   private copy of libcuda, dlmopen into a new link-map namespace
 *   vgpu-escape raw [hold]          the driver's cuMemAlloc_v2 found in its ELF symbol table, no
 *                                   dynamic linker asked (what a static binary or raw ioctls do)
 *   vgpu-escape zero [hold]         take the quota, zero the accounting region, take more
 *   vgpu-escape fifo                replace the accounting region by a FIFO (for whoever reads it)
 *   vgpu-escape forge [hold]        take one block, then write in the region that this process holds
 *                                   1,000,000 MiB on each GPU and waits for 2048 MiB more
 *   vgpu-escape userns              a new user and mount namespace, a tmpfs over the limits file,
 *                                   then blocks in a fresh process
 *   vgpu-escape connect IP PORT     a TCP connection to a Tessera component (the extender's verbs)
 * With hold, the blocks stay allocated until the process is killed ("holding" is printed), so the
 * driver's view (NVML) can be watched from the node.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <link.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "region.h" /* the hook's own layout of the region (hook/src) */

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef void *(*dlsym_fn)(void *, const char *);
typedef void *(*dlvsym_fn)(void *, const char *, const char *);

enum { CUDA_SUCCESS = 0, CUDA_ERROR_OUT_OF_MEMORY = 2, MAX_BLOCKS = 16 };
#define BLOCK ((size_t)256 << 20)
#define LIMITS_FILE "/var/run/tessera/limits.d/limits"
#define LIMITS_DIR "/var/run/tessera"
#define DEFAULT_REGION "/var/run/tessera/state/region"

static const char *const glibc_versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
static void *cuda;      /* libcuda.so.1 as dlopen gives it */
static free_fn release; /* cuMemFree_v2 through the same dlsym */
static CUdeviceptr held[4 * MAX_BLOCKS];
static int nheld;

/* The driver's entry points by the given lookup, a context made current through them. */
static int start_driver(void *(*lookup)(const char *)) {
    CUresult (*init)(unsigned) = (CUresult(*)(unsigned))lookup("cuInit");
    CUresult (*get)(CUdevice *, int) = (CUresult(*)(CUdevice *, int))lookup("cuDeviceGet");
    CUresult (*retain)(CUcontext *, CUdevice) = (CUresult(*)(CUcontext *, CUdevice))lookup("cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = (CUresult(*)(CUcontext))lookup("cuCtxSetCurrent");
    CUdevice device;
    CUcontext ctx;
    return init && get && retain && set && !init(0) && !get(&device, 0) && !retain(&ctx, device) && !set(ctx);
}

static void *by_dlsym(const char *name) { return dlsym(cuda, name); }

/* Blocks got through `alloc` until refused; kept in `held` when keep, else freed with `release_fn`. */
static int take(alloc_fn alloc, free_fn release_fn, int keep) {
    CUdeviceptr got[MAX_BLOCKS];
    int n = 0;
    while (n < MAX_BLOCKS && alloc(&got[n], BLOCK) == CUDA_SUCCESS)
        n++;
    for (int i = 0; i < n; i++) {
        if (keep && nheld < (int)(sizeof held / sizeof *held))
            held[nheld++] = got[i];
        else
            release_fn(got[i]);
    }
    return n;
}

static void report(const char *attempt, const char *found, alloc_fn alloc) {
    if (!alloc) {
        printf("%s %s -\n", attempt, found);
        return;
    }
    printf("%s %s %d\n", attempt, found, take(alloc, release, 0));
}

static const char *whose(void *got, void *hooks) { return !got ? "absent" : got == hooks ? "hook" : "other"; }

static void hold_if(int argc, char **argv) {
    if (argc > 2 && strcmp(argv[2], "hold") == 0) {
        printf("holding\n");
        fflush(stdout);
        for (;;)
            pause();
    }
}

/* ---- routes around the dynamic linker's answer ------------------------------------------------- */

static void dlvsym_routes(void *libc) {
    void *hooks_alloc = dlsym(cuda, "cuMemAlloc_v2");
    struct { const char *name; void *handle; } dlsym_via[] = {
        {"dlvsym-next-dlsym", RTLD_NEXT}, {"dlvsym-default-dlsym", RTLD_DEFAULT}, {"dlvsym-libc-dlsym", libc}};
    for (size_t k = 0; k < sizeof dlsym_via / sizeof *dlsym_via; k++) {
        void *got = NULL;
        for (size_t i = 0; !got && i < sizeof glibc_versions / sizeof *glibc_versions; i++)
            got = dlvsym(dlsym_via[k].handle, "dlsym", glibc_versions[i]);
        report(dlsym_via[k].name, whose(got, (void *)dlsym), got ? (alloc_fn)((dlsym_fn)got)(cuda, "cuMemAlloc_v2") : NULL);
    }
    void *got = dlvsym(RTLD_NEXT, "cuMemAlloc_v2", "libcuda.so.1");
    report("dlvsym-next-alloc", whose(got, hooks_alloc), (alloc_fn)got);
    /* dlsym asked for dlvsym, then that asked for glibc's dlsym. */
    struct { const char *name; dlvsym_fn via; } dlvsym_via[] = {
        {"dlsym-libc-dlvsym", (dlvsym_fn)dlsym(libc, "dlvsym")}, {"dlsym-next-dlvsym", (dlvsym_fn)dlsym(RTLD_NEXT, "dlvsym")}};
    for (size_t k = 0; k < sizeof dlvsym_via / sizeof *dlvsym_via; k++) {
        void *inner = NULL;
        for (size_t i = 0; dlvsym_via[k].via && !inner && i < sizeof glibc_versions / sizeof *glibc_versions; i++)
            inner = dlvsym_via[k].via(libc, "dlsym", glibc_versions[i]);
        report(dlvsym_via[k].name, whose((void *)dlvsym_via[k].via, (void *)dlvsym),
               inner ? (alloc_fn)((dlsym_fn)inner)(cuda, "cuMemAlloc_v2") : NULL);
    }
}

/* The path libcuda.so.1 was loaded from. */
static const char *driver_path(void) {
    static char path[4096];
    struct link_map *map = NULL;
    if (dlinfo(cuda, RTLD_DI_LINKMAP, &map) != 0 || !map)
        return NULL;
    snprintf(path, sizeof path, "%s", map->l_name);
    return path;
}

static int copy_file(const char *from, const char *to) {
    int in = open(from, O_RDONLY | O_CLOEXEC), out = open(to, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0755);
    char buffer[65536];
    ssize_t n = 0;
    while (in >= 0 && out >= 0 && (n = read(in, buffer, sizeof buffer)) > 0)
        if (write(out, buffer, (size_t)n) != n)
            n = -1;
    int ok = in >= 0 && out >= 0 && n == 0;
    if (in >= 0)
        close(in);
    if (out >= 0)
        close(out);
    return ok;
}

static void private_copies(void) {
    void *hooks_alloc = dlsym(cuda, "cuMemAlloc_v2");
    const char *path = driver_path();
    const char *copy = "/tmp/libcuda-private.so.1";
    void *h = path && copy_file(path, copy) ? dlopen(copy, RTLD_NOW | RTLD_LOCAL) : NULL;
    void *got = h ? dlsym(h, "cuMemAlloc_v2") : NULL;
    report("private-copy", h ? whose(got, hooks_alloc) : "unloadable", (alloc_fn)got);
    /* A new link-map namespace has none of the preloaded libraries; its own dlsym is the way in.
     * By path: the new namespace searches only the default directories. */
    void *ns = path ? dlmopen(LM_ID_NEWLM, path, RTLD_NOW | RTLD_LOCAL) : NULL;
    if (!ns)
        fprintf(stderr, "dlmopen %s: %s\n", path ? path : "libcuda.so.1", dlerror());
    got = ns ? dlsym(ns, "cuMemAlloc_v2") : NULL;
    report("dlmopen-dlsym", ns ? whose(got, hooks_alloc) : "unloadable", (alloc_fn)got);
    Lmid_t lmid;
    void *ns_libc = ns && dlinfo(ns, RTLD_DI_LMID, &lmid) == 0 ? dlmopen(lmid, "libc.so.6", RTLD_NOW) : NULL;
    void *ns_dlsym = ns_libc ? dlsym(ns_libc, "dlsym") : NULL;
    got = ns_dlsym ? ((dlsym_fn)ns_dlsym)(ns, "cuMemAlloc_v2") : NULL;
    report("dlmopen-own-dlsym", whose(ns_dlsym, (void *)dlsym), (alloc_fn)got);
}

/* ---- the driver's own function, from its symbol table ------------------------------------------ */

struct found {
    const char *name;
    void *address;
};

/* dl_iterate_phdr callback: `name` in libcuda's .dynsym, read from the file it was loaded from. */
static int find_in_driver(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct found *want = data;
    if (!strstr(info->dlpi_name, "libcuda.so"))
        return 0;
    int fd = open(info->dlpi_name, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0)
        return 0;
    const unsigned char *file = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (file == MAP_FAILED)
        return 0;
    const Elf64_Ehdr *eh = (const Elf64_Ehdr *)file;
    const Elf64_Shdr *sections = (const Elf64_Shdr *)(file + eh->e_shoff);
    for (int i = 0; i < eh->e_shnum && !want->address; i++) {
        if (sections[i].sh_type != SHT_DYNSYM)
            continue;
        const Elf64_Sym *syms = (const Elf64_Sym *)(file + sections[i].sh_offset);
        const char *names = (const char *)(file + sections[sections[i].sh_link].sh_offset);
        for (size_t k = 0; k < sections[i].sh_size / sizeof *syms; k++)
            if (syms[k].st_value && strcmp(names + syms[k].st_name, want->name) == 0)
                want->address = (void *)(info->dlpi_addr + syms[k].st_value);
    }
    munmap((void *)file, (size_t)st.st_size);
    return want->address != NULL;
}

static void *raw(const char *name) {
    struct found want = {name, NULL};
    dl_iterate_phdr(find_in_driver, &want);
    return want.address;
}

/* ---- the accounting region --------------------------------------------------------------------- */

/* The region path the limits file names (the hook's, in a container the device plugin served). */
static const char *region_path(void) {
    static char path[4096] = DEFAULT_REGION;
    FILE *f = fopen(LIMITS_FILE, "re");
    char line[4200];
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "region %4095s", path) == 1)
            break;
    if (f)
        fclose(f);
    return path;
}

static int zero_region(void) {
    int fd = open(region_path(), O_WRONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0)
        return 0;
    char zeros[4096] = {0};
    int ok = 1;
    for (off_t at = 0; at < st.st_size && ok; at += (off_t)sizeof zeros)
        ok = pwrite(fd, zeros, sizeof zeros, at) > 0;
    close(fd);
    return ok;
}

/* What a forged region claims: far more than any GPU has, and a wait (which a borrower would be
 * evicted for, were the region believed). */
#define FORGED_USED ((uint64_t)1000000 << 20)
#define FORGED_WAITING ((uint64_t)2048 << 20)

/* Write, in this process's own slot and in the device totals, the forged use (the region is the
 * container's to write: every process with the hook updates it). */
static int forge_region(void) {
    int fd = open(region_path(), O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(struct vgpu_region))
        return 0;
    struct vgpu_region *r = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (r == MAP_FAILED || r->magic != VGPU_REGION_MAGIC)
        return 0;
    int found = 0;
    for (uint32_t slot = 0; slot < r->procs_hw && slot < VGPU_MAX_PROCS; slot++) {
        if (r->proc[slot].pid != getpid())
            continue;
        for (uint32_t d = 0; d < r->devices && d < VGPU_MAX_DEVICES; d++) {
            r->proc[slot].used[d] = FORGED_USED;
            r->proc[slot].waiting[d] = FORGED_WAITING;
            r->dev[d].used = FORGED_USED;
        }
        found = 1;
    }
    munmap(r, sizeof *r);
    return found;
}

/* ---- files the node agent mounted read-only ---------------------------------------------------- */

static void try_write(const char *attempt, const char *path, int flags) {
    int fd = open(path, O_WRONLY | O_CLOEXEC | flags, 0644);
    if (fd >= 0) {
        close(fd);
        printf("%s opened -\n", attempt);
    } else {
        printf("%s %s -\n", attempt, strerrorname_np(errno));
    }
}

/* A slot beside the container's own in its GPU's coordination area (its class's directory). */
static void try_coordination(void) {
    FILE *f = fopen(LIMITS_FILE, "re");
    char line[4200], area[4096] = "", uuid[128] = "", qos[64] = "standard", path[4400];
    while (f && fgets(line, sizeof line, f)) {
        sscanf(line, "coordination %4095s", area);
        sscanf(line, "device %127s", uuid);
        sscanf(line, "qos %63s", qos);
    }
    if (f)
        fclose(f);
    if (!area[0] || !uuid[0]) {
        printf("write-coordination absent -\n");
        return;
    }
    snprintf(path, sizeof path, "%s/%s/%s/forged", area, uuid, qos);
    try_write("write-coordination", path, O_CREAT);
}

/* ---- the network ------------------------------------------------------------------------------ */

/* "connect answered -" when something accepted the connection and answered a request, else why not. */
static int try_connect(const char *address, const char *port) {
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(port))};
    struct timeval timeout = {.tv_sec = 5};
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || inet_pton(AF_INET, address, &to.sin_addr) != 1) {
        printf("connect bad-address -\n");
        return 1;
    }
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    const char request[] = "GET /healthz HTTP/1.0\r\n\r\n";
    char answer[64];
    if (connect(fd, (struct sockaddr *)&to, sizeof to) != 0)
        printf("connect %s -\n", strerrorname_np(errno));
    else if (write(fd, request, sizeof request - 1) < 0 || read(fd, answer, sizeof answer) <= 0)
        printf("connect silent -\n");
    else
        printf("connect answered -\n");
    close(fd);
    return 0;
}

/* ---- main -------------------------------------------------------------------------------------- */

static int rerun(char *self, const char *mode, char *const *env) {
    pid_t child = fork();
    if (child == 0) {
        char *args[] = {self, (char *)mode, NULL};
        execve("/proc/self/exe", args, env);
        _exit(127);
    }
    int status = 0;
    waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *mode = argc > 1 ? argv[1] : "";
    if (strcmp(mode, "write") == 0) {
        try_write("write-preload", "/etc/ld.so.preload", 0);
        try_write("write-limits", LIMITS_FILE, 0);
        /* A file of its own renamed over the limits file, as a live resize replaces it. */
        try_write("write-limits-dir", "/var/run/tessera/limits.d/forged", O_CREAT);
        try_write("write-hook", "/usr/local/tessera/libvgpu.so", 0);
        try_coordination();
        return 0;
    }
    if (strcmp(mode, "connect") == 0 && argc == 4)
        return try_connect(argv[2], argv[3]);
    if (strcmp(mode, "userns") == 0) {
        if (unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) {
            printf("userns %s -\n", strerrorname_np(errno));
            return 0;
        }
        if (mount("none", LIMITS_DIR, "tmpfs", 0, NULL) != 0) {
            printf("userns-tmpfs %s -\n", strerrorname_np(errno));
            return 0;
        }
        printf("userns-tmpfs mounted -\n");
        return rerun(argv[0], "blocks", environ);
    }
    if (strcmp(mode, "preload") == 0) {
        /* The environment without LD_PRELOAD, then with it naming a library of the tenant's. */
        static char *env[512], elsewhere[] = "LD_PRELOAD=/tmp/none.so";
        size_t n = 0;
        for (char **e = environ; *e && n + 2 < sizeof env / sizeof *env; e++)
            if (strncmp(*e, "LD_PRELOAD=", 11) != 0)
                env[n++] = *e;
        printf("preload-unset\n");
        int a = rerun(argv[0], "blocks", env);
        env[n] = elsewhere;
        printf("preload-elsewhere\n");
        return a | rerun(argv[0], "blocks", env);
    }
    if (strcmp(mode, "raw") == 0) {
        /* The library is mapped (a static binary has its own copy), but no lookup goes through the
         * dynamic linker, where the hook answers. */
        cuda = dlopen("libcuda.so.1", RTLD_NOW);
        free_fn raw_free = (free_fn)raw("cuMemFree_v2");
        alloc_fn raw_alloc = (alloc_fn)raw("cuMemAlloc_v2");
        if (!raw_free || !raw_alloc || !start_driver(raw)) {
            printf("raw absent -\n");
            return 1;
        }
        printf("raw driver %d\n", take(raw_alloc, raw_free, 1));
        hold_if(argc, argv);
        return 0;
    }
    if (strcmp(mode, "fifo") == 0) {
        const char *path = region_path();
        int ok = unlink(path) == 0 && mkfifo(path, 0666) == 0;
        printf("fifo %s -\n", ok ? "made" : strerrorname_np(errno));
        return !ok;
    }
    cuda = dlopen("libcuda.so.1", RTLD_NOW);
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    release = cuda ? (free_fn)dlsym(cuda, "cuMemFree_v2") : NULL;
    alloc_fn alloc = cuda ? (alloc_fn)dlsym(cuda, "cuMemAlloc_v2") : NULL;
    if (!libc || !release || !alloc || !start_driver(by_dlsym)) {
        printf("%s absent -\n", mode);
        return 1;
    }
    if (strcmp(mode, "blocks") == 0) {
        printf("blocks hook %d\n", take(alloc, release, argc > 2));
        hold_if(argc, argv);
    } else if (strcmp(mode, "routes") == 0) {
        report("dlsym-handle", "hook", alloc); /* the control */
        dlvsym_routes(libc);
        private_copies();
    } else if (strcmp(mode, "forge") == 0) {
        CUdeviceptr one;
        if (alloc(&one, BLOCK) != CUDA_SUCCESS || !forge_region()) {
            printf("forge %s -\n", errno ? strerrorname_np(errno) : "refused");
            return 1;
        }
        printf("forge written 1\n");
        hold_if(argc, argv);
    } else if (strcmp(mode, "zero") == 0) {
        printf("zero-before hook %d\n", take(alloc, release, 1));
        if (!zero_region()) {
            printf("zero %s -\n", strerrorname_np(errno));
            return 1;
        }
        printf("zero-after hook %d\n", take(alloc, release, 1));
        hold_if(argc, argv);
    } else {
        fprintf(stderr, "usage: vgpu-escape blocks|preload|write|routes|raw|zero|forge|fifo|userns [hold] | connect IP PORT\n");
        return 2;
    }
    return 0;
}
