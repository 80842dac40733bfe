/* Where the quotas come from, read once per process: the limits file, or the environment; and, from
 * a limits file, their live changes (vgpu_limits_resize, live resize).
 *
 * Managed (in Kubernetes): the device plugin mounts this library read-only at VGPU_HOOK_FILE and
 * names it in /etc/ld.so.preload, and mounts a read-only limits file at VGPU_LIMITS_FILE (both
 * compiled in; tessera.contract). The hook counts itself managed when it was loaded from
 * VGPU_HOOK_FILE, or when that file is there at all (a copy of the library preloaded from elsewhere
 * is managed too). Nothing the container controls can undo either: not its environment, not files it
 * can write; only a process able to mount over both (which could equally run without the hook, see
 * docs/security.md). Managed, the limits file is the only source: missing, unreadable or broken, it
 * fails closed (no device memory, the smallest compute share), and no environment variable is read.
 *
 * Unmanaged (tests, standalone): the compiled-in limits file when it exists, else TESSERA_LIMITS_FILE
 * (tests), else the standalone variables (their names are in contract.h). Any error fails closed: a
 * message on stderr and no device memory.
 *
 * The parser (vgpu_limits_parse) is a pure function of the file's bytes, so that the fuzzer
 * (hook/fuzz/) drives it exactly as the hook does. */
#define _GNU_SOURCE
#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "vgpu.h"

#ifndef VGPU_LIMITS_FILE
#error "VGPU_LIMITS_FILE must be defined by the build (hook/Makefile)"
#endif
#ifndef VGPU_REGION_FILE
#error "VGPU_REGION_FILE must be defined by the build (hook/Makefile)"
#endif
#ifndef VGPU_HOOK_FILE
#error "VGPU_HOOK_FILE must be defined by the build (hook/Makefile)"
#endif

/* The compute share of each GPU when a managed container's limits cannot be read: the smallest the
 * format can express, since the container was granted some share and nothing says how much. */
#define FAIL_CLOSED_CORES 1

static struct vgpu_limits limits;
static pthread_once_t limits_once = PTHREAD_ONCE_INIT;
/* The limits file the quotas came from, and its identity when last read (live resize: the device
 * plugin replaces the file by a rename, which makes a new inode). Read and written by the process's
 * one monitor thread after the load. */
static const char *limits_path;
struct file_identity {
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime, ctime;
};
static struct file_identity limits_seen;

VGPU_API const char *vgpu_default_limits_path(void) { return VGPU_LIMITS_FILE; }
VGPU_API const char *vgpu_default_region_path(void) { return VGPU_REGION_FILE; }
VGPU_API const char *vgpu_default_hook_path(void) { return VGPU_HOOK_FILE; }

/* A decimal count of bytes with an optional k, m or g suffix (powers of 1024); 0 if invalid. */
static uint64_t parse_bytes(const char *text) {
    if (!isdigit((unsigned char)text[0])) return 0;
    errno = 0;
    char *end;
    unsigned long long value = strtoull(text, &end, 10);
    if (errno) return 0;
    unsigned shift = 0;
    switch (tolower((unsigned char)*end)) {
    case 'k': shift = 10; end++; break;
    case 'm': shift = 20; end++; break;
    case 'g': shift = 30; end++; break;
    default: break;
    }
    if (*end || value > (UINT64_MAX >> shift)) return 0;
    return (uint64_t)value << shift;
}

/* An integer in [lo, hi]; -1 if invalid. */
static int parse_int(const char *text, int lo, int hi) {
    if (!isdigit((unsigned char)text[0])) return -1;
    errno = 0;
    char *end;
    long value = strtol(text, &end, 10);
    if (errno || *end || value < lo || value > hi) return -1;
    return (int)value;
}

/* Records why the configuration is refused (the first reason only); the caller logs it once. */
__attribute__((format(printf, 2, 3))) static void refuse(struct vgpu_limits *l, const char *fmt, ...) {
    if (!l->refuse_memory) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(l->why, sizeof l->why, fmt, ap);
        va_end(ap);
    }
    l->refuse_memory = 1;
}

static int parse_device_line(struct vgpu_limits *l, char **tok, int ntok, const char *where) {
    if (ntok != 6 || strcmp(tok[2], "memory") || strcmp(tok[4], "cores")) {
        refuse(l, "%s: expected `device <uuid> memory <bytes> cores <0-%d>`", where, VGPU_MAX_CORES);
        return -1;
    }
    if (strlen(tok[1]) >= VGPU_UUID_LEN) {
        refuse(l, "%s: uuid %s is too long", where, tok[1]);
        return -1;
    }
    if (l->file_devices == VGPU_MAX_DEVICES) {
        refuse(l, "%s: more devices than the hook supports", where);
        return -1;
    }
    uint64_t memory = strspn(tok[3], "0123456789") == strlen(tok[3]) ? parse_bytes(tok[3]) : 0; /* bytes only */
    int cores = parse_int(tok[5], 0, VGPU_MAX_CORES);
    if (!memory) {
        refuse(l, "%s: memory %s is not a positive number of bytes", where, tok[3]);
        return -1;
    }
    if (cores < 0) {
        refuse(l, "%s: cores %s is not in 0..%d", where, tok[5], VGPU_MAX_CORES);
        return -1;
    }
    int i = l->file_devices++;
    snprintf(l->by_uuid[i].uuid, VGPU_UUID_LEN, "%s", tok[1]);
    l->by_uuid[i].quota = (struct vgpu_quota){.memory_quota = memory, .cores = cores};
    return 0;
}

/* A QoS class by name; -1 if none. */
static int parse_qos(const char *name) {
    if (!strcmp(name, VGPU_QOS_LATENCY_CRITICAL)) return VGPU_QOS_CLASS_LATENCY_CRITICAL;
    if (!strcmp(name, VGPU_QOS_STANDARD)) return VGPU_QOS_CLASS_STANDARD;
    if (!strcmp(name, VGPU_QOS_BEST_EFFORT)) return VGPU_QOS_CLASS_BEST_EFFORT;
    return -1;
}

#define QOS_NAMES VGPU_QOS_LATENCY_CRITICAL ", " VGPU_QOS_STANDARD " or " VGPU_QOS_BEST_EFFORT

/* The lines of version 2: `qos <class>`, `coordination <absolute dir>` (a repeated line wins). */
static int parse_qos_line(struct vgpu_limits *l, char **tok, int version, const char *where) {
    static const int since = 2;
    if (version < since) {
        refuse(l, "%s: `%s` needs `version %d` (or later) before it", where, tok[0], since);
        return -1;
    }
    if (!strcmp(tok[0], "qos")) {
        int qos = parse_qos(tok[1]);
        if (qos < 0) {
            refuse(l, "%s: qos %s is not " QOS_NAMES, where, tok[1]);
            return -1;
        }
        l->qos = (enum vgpu_qos)qos;
        return 0;
    }
    if (tok[1][0] != '/') {
        refuse(l, "%s: coordination %s is not an absolute path", where, tok[1]);
        return -1;
    }
    if (snprintf(l->coordination, sizeof l->coordination, "%s", tok[1]) >= (int)sizeof l->coordination) {
        refuse(l, "%s: coordination path is too long", where);
        return -1;
    }
    return 0;
}

/* `oversubscribed <uuid> wait <ms>` (version 3): best-effort containers borrow memory of the GPU of an
 * earlier device line; an allocation the driver refuses for lack of memory waits up to ms. */
static int parse_oversubscribed_line(struct vgpu_limits *l, char **tok, int ntok, int version, const char *where) {
    if (version < VGPU_LIMITS_OVERSUBSCRIBED_VERSION) {
        refuse(l, "%s: `oversubscribed` needs `version %d` (or later) before it", where,
               VGPU_LIMITS_OVERSUBSCRIBED_VERSION);
        return -1;
    }
    if (ntok != 4 || strcmp(tok[2], "wait")) {
        refuse(l, "%s: expected `oversubscribed <uuid> wait <0-%d milliseconds>`", where, VGPU_MAX_SHORTFALL_WAIT_MS);
        return -1;
    }
    int ms = parse_int(tok[3], 0, VGPU_MAX_SHORTFALL_WAIT_MS);
    if (ms < 0) {
        refuse(l, "%s: wait %s is not in 0..%d milliseconds", where, tok[3], VGPU_MAX_SHORTFALL_WAIT_MS);
        return -1;
    }
    for (int i = 0; i < l->file_devices; i++) {
        if (!strcmp(l->by_uuid[i].uuid, tok[1])) {
            l->by_uuid[i].quota.wait_ms = ms;
            return 0;
        }
    }
    refuse(l, "%s: GPU %s has no device line before it", where, tok[1]);
    return -1;
}

/* The arguments of an `mps` line or TESSERA_MPS, tok[0..4]: `<absolute pipe directory> threads
 * <1-100> priority <0|1>`. 0, or -1 once refused. */
static int parse_mps(struct vgpu_limits *l, char **tok, int ntok, const char *where) {
    int threads = ntok == 5 && !strcmp(tok[1], "threads") ? parse_int(tok[2], 1, VGPU_MAX_CORES) : -1;
    int priority = ntok == 5 && !strcmp(tok[3], "priority") ? parse_int(tok[4], 0, 1) : -1;
    if (ntok != 5 || tok[0][0] != '/' || threads < 0 || priority < 0) {
        refuse(l, "%s: expected `mps <absolute pipe directory> threads <1-%d> priority <0|1>`", where, VGPU_MAX_CORES);
        return -1;
    }
    if (snprintf(l->mps.pipe, sizeof l->mps.pipe, "%s", tok[0]) >= (int)sizeof l->mps.pipe) {
        l->mps.pipe[0] = 0;
        refuse(l, "%s: mps pipe directory is too long", where);
        return -1;
    }
    l->mps.threads = threads;
    l->mps.priority = priority;
    return 0;
}

/* One line, NUL-terminated, without its newline: 0, or -1 once refused. */
static int parse_line(struct vgpu_limits *l, char *line, int *version, const char *where) {
    char *hash = strchr(line, '#');
    if (hash) *hash = 0;
    char *tok[8];
    int ntok = 0;
    for (char *save = NULL, *t = strtok_r(line, " \t\r", &save); t && ntok < 8; t = strtok_r(NULL, " \t\r", &save))
        tok[ntok++] = t;
    if (ntok == 0) return 0;
    if (!strcmp(tok[0], "version") && ntok == 2) {
        *version = parse_int(tok[1], 0, INT_MAX);
        if (*version < VGPU_LIMITS_OLDEST_VERSION || *version > VGPU_LIMITS_VERSION) {
            refuse(l, "%s: version %s is not %d..%d", where, tok[1], VGPU_LIMITS_OLDEST_VERSION, VGPU_LIMITS_VERSION);
            return -1;
        }
    } else if (!strcmp(tok[0], "region") && ntok == 2) {
        if (tok[1][0] != '/') {
            refuse(l, "%s: region %s is not an absolute path", where, tok[1]);
            return -1;
        }
        if (snprintf(l->region, sizeof l->region, "%s", tok[1]) >= (int)sizeof l->region) {
            refuse(l, "%s: region path is too long", where);
            return -1;
        }
    } else if (!strcmp(tok[0], "elastic") && ntok == 2) {
        l->elastic = parse_int(tok[1], 0, 1);
        if (l->elastic < 0) {
            l->elastic = 0;
            refuse(l, "%s: elastic %s is not 0 or 1", where, tok[1]);
            return -1;
        }
    } else if ((!strcmp(tok[0], "qos") || !strcmp(tok[0], "coordination")) && ntok == 2) {
        return parse_qos_line(l, tok, *version, where);
    } else if (!strcmp(tok[0], "device")) {
        return parse_device_line(l, tok, ntok, where);
    } else if (!strcmp(tok[0], "oversubscribed")) {
        return parse_oversubscribed_line(l, tok, ntok, *version, where);
    } else if (!strcmp(tok[0], "mps")) {
        if (*version < VGPU_LIMITS_MPS_VERSION) {
            refuse(l, "%s: `mps` needs `version %d` (or later) before it", where, VGPU_LIMITS_MPS_VERSION);
            return -1;
        }
        return parse_mps(l, tok + 1, ntok - 1, where);
    } else {
        refuse(l, "%s: unknown line starting with %s", where, tok[0]);
        return -1;
    }
    return 0;
}

int vgpu_limits_parse(struct vgpu_limits *l, const char *text, size_t len, const char *name) {
    char line[VGPU_LIMITS_MAX_LINE], where[PATH_MAX + 32];
    int lineno = 0, version = 0;
    l->from_file = 1;
    snprintf(l->region, sizeof l->region, "%s", VGPU_REGION_FILE);
    if (memchr(text, 0, len)) {
        refuse(l, "limits file %s: contains a NUL byte", name);
        return -1;
    }
    for (size_t at = 0; at < len;) {
        const char *newline = memchr(text + at, '\n', len - at);
        size_t n = (newline ? (size_t)(newline - text) : len) - at;
        lineno++;
        snprintf(where, sizeof where, "limits file %s line %d", name, lineno);
        if (n >= sizeof line) {
            refuse(l, "%s: longer than %zu bytes", where, sizeof line - 1);
            return -1;
        }
        memcpy(line, text + at, n);
        line[n] = 0;
        at += n + 1;
        if (parse_line(l, line, &version, where)) return -1;
    }
    if (!version) {
        refuse(l, "limits file %s: no `version %d` line", name, VGPU_LIMITS_VERSION);
        return -1;
    }
    if (!l->file_devices) {
        refuse(l, "limits file %s: no device lines", name);
        return -1;
    }
    return 0;
}

/* Reads the file whole (and notes which file it was in *seen, unless NULL), refusing anything but a
 * regular file of sane size: O_NONBLOCK so that a FIFO put in its place cannot hang the process,
 * O_NOFOLLOW since the device plugin writes a file, never a link. */
static struct file_identity identity(const struct stat *st) {
    return (struct file_identity){st->st_dev, st->st_ino, st->st_size, st->st_mtim, st->st_ctim};
}

static void read_limits_file(struct vgpu_limits *l, const char *path, struct file_identity *seen) {
    static char text[VGPU_LIMITS_MAX_BYTES]; /* under limits_once, then by the monitor thread alone */
    snprintf(l->region, sizeof l->region, "%s", VGPU_REGION_FILE);
    l->from_file = 1;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        refuse(l, "limits file %s: %s", path, strerror(errno));
        return;
    }
    struct stat st;
    int known = fstat(fd, &st) == 0;
    if (known && seen) *seen = identity(&st);
    if (!known) {
        refuse(l, "limits file %s: %s", path, strerror(errno));
    } else if (!S_ISREG(st.st_mode)) {
        refuse(l, "limits file %s: not a regular file", path);
    } else if (st.st_size > (off_t)sizeof text) {
        refuse(l, "limits file %s: larger than %zu bytes", path, sizeof text);
    } else {
        size_t len = 0;
        ssize_t n;
        while (len < sizeof text && ((n = read(fd, text + len, sizeof text - len)) > 0 || (n < 0 && errno == EINTR)))
            if (n > 0) len += (size_t)n;
        if (len == sizeof text) refuse(l, "limits file %s: larger than %zu bytes", path, sizeof text);
        else vgpu_limits_parse(l, text, len, path);
    }
    close(fd);
}

static void read_environment(struct vgpu_limits *l) {
    l->all = (struct vgpu_quota){.memory_quota = VGPU_UNLIMITED, .cores = 0};
    const char *value = getenv(VGPU_ENV_MEMORY_LIMIT);
    if (value && !(l->all.memory_quota = parse_bytes(value)))
        refuse(l, VGPU_ENV_MEMORY_LIMIT "=%s is not a positive number of bytes (suffix k, m or g allowed)", value);
    value = getenv(VGPU_ENV_CORES);
    if (value && (l->all.cores = parse_int(value, 1, VGPU_MAX_CORES)) < 0)
        refuse(l, VGPU_ENV_CORES "=%s is not in 1..%d", value, VGPU_MAX_CORES);
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) {
        char name[64];
        l->by_ordinal[i] = (struct vgpu_quota){.memory_quota = 0, .cores = -1};
        snprintf(name, sizeof name, VGPU_ENV_MEMORY_LIMIT "_%d", i);
        if ((value = getenv(name))) {
            l->has_ordinal_quotas = 1;
            if (!(l->by_ordinal[i].memory_quota = parse_bytes(value)))
                refuse(l, "%s=%s is not a positive number of bytes (suffix k, m or g allowed)", name, value);
        }
        snprintf(name, sizeof name, VGPU_ENV_CORES "_%d", i);
        if ((value = getenv(name))) {
            l->has_ordinal_quotas = 1;
            if ((l->by_ordinal[i].cores = parse_int(value, 1, VGPU_MAX_CORES)) < 0)
                refuse(l, "%s=%s is not in 1..%d", name, value, VGPU_MAX_CORES);
        }
    }
    value = getenv(VGPU_ENV_ELASTIC);
    if (value && (l->elastic = parse_int(value, 0, 1)) < 0) {
        l->elastic = 0;
        refuse(l, VGPU_ENV_ELASTIC "=%s is not 0 or 1", value);
    }
    value = getenv(VGPU_ENV_REGION);
    if (value && snprintf(l->region, sizeof l->region, "%s", value) >= (int)sizeof l->region)
        refuse(l, VGPU_ENV_REGION "=%s is too long", value);
    value = getenv(VGPU_ENV_QOS);
    int qos = value ? parse_qos(value) : VGPU_QOS_CLASS_STANDARD;
    if (qos < 0) refuse(l, VGPU_ENV_QOS "=%s is not " QOS_NAMES, value);
    else l->qos = (enum vgpu_qos)qos;
    value = getenv(VGPU_ENV_COORDINATION);
    if (value && value[0] != '/') refuse(l, VGPU_ENV_COORDINATION "=%s is not an absolute path", value);
    else if (value && snprintf(l->coordination, sizeof l->coordination, "%s", value) >= (int)sizeof l->coordination)
        refuse(l, VGPU_ENV_COORDINATION "=%s is too long", value);
    if ((value = getenv(VGPU_ENV_MPS))) {
        char copy[PATH_MAX + 64], *tok[6];
        int ntok = 0;
        snprintf(copy, sizeof copy, "%s", value);
        for (char *save = NULL, *t = strtok_r(copy, " \t", &save); t && ntok < 6; t = strtok_r(NULL, " \t", &save))
            tok[ntok++] = t;
        parse_mps(l, tok, ntok, VGPU_ENV_MPS);
    }
}

/* Managed: this library was loaded from the path the device plugin mounts it at (the loader's own
 * record of the name, fixed at load: a mount made later changes nothing), or that path exists. Only
 * "no such file" counts as absent: any other error reads as managed. */
static int managed_by_tessera(void) {
    Dl_info self;
    if (dladdr((void *)vgpu_limits, &self) && self.dli_fname && !strcmp(self.dli_fname, VGPU_HOOK_FILE)) return 1;
    return access(VGPU_HOOK_FILE, F_OK) == 0 || errno != ENOENT;
}

static void load(void) {
    limits.managed = managed_by_tessera();
    if (limits.managed || access(VGPU_LIMITS_FILE, F_OK) == 0 || errno != ENOENT) {
        limits_path = VGPU_LIMITS_FILE;
    } else {
        const char *override = getenv(VGPU_ENV_LIMITS_FILE);
        if (override && *override) limits_path = override;
    }
    if (limits_path) read_limits_file(&limits, limits_path, &limits_seen);
    else read_environment(&limits);
    if (limits.managed && limits.refuse_memory)
        limits.all = (struct vgpu_quota){.memory_quota = 0, .cores = FAIL_CLOSED_CORES};
    if (limits.refuse_memory) vgpu_log("%s; refusing device memory", limits.why);
}

const struct vgpu_limits *vgpu_limits(void) {
    pthread_once(&limits_once, load);
    return &limits;
}

static int same_file(const struct file_identity *a, const struct file_identity *b) {
    return a->dev == b->dev && a->ino == b->ino && a->size == b->size && a->mtime.tv_sec == b->mtime.tv_sec &&
           a->mtime.tv_nsec == b->mtime.tv_nsec && a->ctime.tv_sec == b->ctime.tv_sec &&
           a->ctime.tv_nsec == b->ctime.tv_nsec;
}

/* Live resize. The quotas of a limits file that was read whole at the start follow the file: when it
 * is another file than the one last read (the device plugin replaces it by a rename), each GPU's
 * quotas become the new file's. Only quotas change (never the GPUs, the class or the paths). A file
 * that cannot be read or parsed, or that lacks a GPU, fails closed on that memory (new allocations
 * refused, nothing freed) until a good one replaces it. One caller: the monitor thread. */
int vgpu_limits_resize(void) {
    const struct vgpu_limits *c = vgpu_limits();
    if (!limits_path || c->refuse_memory) return 0; /* no file, or failed closed from the start */
    struct stat st;
    struct file_identity now = {0};
    if (lstat(limits_path, &st) == 0) now = identity(&st);
    if (same_file(&now, &limits_seen)) return 0;
    limits_seen = now; /* a file that cannot be read is tried again once it changes, not every period */
    static struct vgpu_limits fresh;
    memset(&fresh, 0, sizeof fresh);
    read_limits_file(&fresh, limits_path, NULL);
    if (fresh.refuse_memory) vgpu_log("%s; refusing new device memory", fresh.why);
    int changed = 0;
    for (int i = 0; i < limits.file_devices; i++) {
        struct vgpu_quota *q = &limits.by_uuid[i].quota;
        struct vgpu_quota next = {.memory_quota = 0, .cores = __atomic_load_n(&q->cores, __ATOMIC_RELAXED), .wait_ms = 0};
        for (int j = 0; !fresh.refuse_memory && j < fresh.file_devices; j++)
            if (!strcmp(fresh.by_uuid[j].uuid, limits.by_uuid[i].uuid)) next = fresh.by_uuid[j].quota;
        if (next.memory_quota != __atomic_load_n(&q->memory_quota, __ATOMIC_RELAXED) ||
            next.cores != __atomic_load_n(&q->cores, __ATOMIC_RELAXED) ||
            next.wait_ms != __atomic_load_n(&q->wait_ms, __ATOMIC_RELAXED)) {
            __atomic_store_n(&q->memory_quota, next.memory_quota, __ATOMIC_RELAXED);
            __atomic_store_n(&q->cores, next.cores, __ATOMIC_RELAXED);
            __atomic_store_n(&q->wait_ms, next.wait_ms, __ATOMIC_RELAXED);
            vgpu_log("GPU %s: quotas now %llu bytes, %d%% compute, shortfall wait %d ms (limits file %s)",
                     limits.by_uuid[i].uuid, (unsigned long long)next.memory_quota, next.cores, next.wait_ms, limits_path);
            changed = 1;
        }
    }
    return changed;
}

struct vgpu_quota vgpu_quota_of(const char *uuid, int ordinal) {
    const struct vgpu_limits *c = vgpu_limits();
    struct vgpu_quota quota = {.memory_quota = 0, .cores = 0};
    if (c->managed && c->refuse_memory) return c->all; /* fail closed, whatever the file got to say */
    if (c->from_file) {
        for (int i = 0; i < c->file_devices; i++)
            if (!strcmp(c->by_uuid[i].uuid, uuid))
                quota = (struct vgpu_quota){__atomic_load_n(&c->by_uuid[i].quota.memory_quota, __ATOMIC_RELAXED),
                                            __atomic_load_n(&c->by_uuid[i].quota.cores, __ATOMIC_RELAXED),
                                            __atomic_load_n(&c->by_uuid[i].quota.wait_ms, __ATOMIC_RELAXED)};
    } else {
        quota = c->all;
        if (ordinal >= 0 && ordinal < VGPU_MAX_DEVICES) {
            if (c->by_ordinal[ordinal].memory_quota) quota.memory_quota = c->by_ordinal[ordinal].memory_quota;
            if (c->by_ordinal[ordinal].cores >= 0) quota.cores = c->by_ordinal[ordinal].cores;
        }
    }
    if (c->refuse_memory) quota.memory_quota = 0;
    return quota;
}
