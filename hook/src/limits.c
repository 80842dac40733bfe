/* Where the quotas come from, read once per process: the limits file, or the environment.
 *
 * In Kubernetes the device plugin mounts a read-only limits file at VGPU_LIMITS_FILE (compiled in;
 * tessera.contract.CONTAINER_LIMITS_FILE). When that file exists it is the only source: no
 * environment variable is looked at, so nothing a container can write raises a limit. Only when it
 * does not exist are TESSERA_LIMITS_FILE (tests) and the standalone variables honoured (their names
 * are in contract.h); a container
 * that can make the mounted file vanish could equally run without the hook, so this opens nothing.
 * Any error fails closed: a message on stderr and no device memory. */
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "vgpu.h"

#ifndef VGPU_LIMITS_FILE
#error "VGPU_LIMITS_FILE must be defined by the build (hook/Makefile)"
#endif
#ifndef VGPU_REGION_FILE
#error "VGPU_REGION_FILE must be defined by the build (hook/Makefile)"
#endif

static struct vgpu_limits limits;
static char limits_path[PATH_MAX];
static pthread_once_t limits_once = PTHREAD_ONCE_INIT;

VGPU_API const char *vgpu_default_limits_path(void) { return VGPU_LIMITS_FILE; }
VGPU_API const char *vgpu_default_region_path(void) { return VGPU_REGION_FILE; }

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

__attribute__((format(printf, 1, 2))) static void refuse(const char *fmt, ...) {
    char why[PATH_MAX + 512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    vgpu_log("%s; refusing device memory", why);
    limits.refuse_memory = 1;
}

static int parse_device_line(char **tok, int ntok, const char *where) {
    if (ntok != 6 || strcmp(tok[2], "memory") || strcmp(tok[4], "cores")) {
        refuse("%s: expected `device <uuid> memory <bytes> cores <0-%d>`", where, VGPU_MAX_CORES);
        return -1;
    }
    if (strlen(tok[1]) >= VGPU_UUID_LEN) {
        refuse("%s: uuid %s is too long", where, tok[1]);
        return -1;
    }
    if (limits.file_devices == VGPU_MAX_DEVICES) {
        refuse("%s: more devices than the hook supports", where);
        return -1;
    }
    uint64_t memory = strspn(tok[3], "0123456789") == strlen(tok[3]) ? parse_bytes(tok[3]) : 0; /* bytes only */
    int cores = parse_int(tok[5], 0, VGPU_MAX_CORES);
    if (!memory) {
        refuse("%s: memory %s is not a positive number of bytes", where, tok[3]);
        return -1;
    }
    if (cores < 0) {
        refuse("%s: cores %s is not in 0..%d", where, tok[5], VGPU_MAX_CORES);
        return -1;
    }
    int i = limits.file_devices++;
    snprintf(limits.by_uuid[i].uuid, VGPU_UUID_LEN, "%s", tok[1]);
    limits.by_uuid[i].quota = (struct vgpu_quota){.memory = memory, .cores = cores};
    return 0;
}

static void read_limits_file(FILE *f) {
    char line[1024], where[PATH_MAX + 32];
    int lineno = 0, version = 0;
    snprintf(limits.region, sizeof limits.region, "%s", VGPU_REGION_FILE);
    while (fgets(line, sizeof line, f)) {
        lineno++;
        snprintf(where, sizeof where, "limits file %s line %d", limits_path, lineno);
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char *tok[8];
        int ntok = 0;
        for (char *save = NULL, *t = strtok_r(line, " \t\r\n", &save); t && ntok < 8;
             t = strtok_r(NULL, " \t\r\n", &save))
            tok[ntok++] = t;
        if (ntok == 0) continue;
        if (!strcmp(tok[0], "version") && ntok == 2) {
            version = parse_int(tok[1], 0, INT_MAX);
            if (version != VGPU_LIMITS_VERSION) {
                refuse("%s: version %s is not %d", where, tok[1], VGPU_LIMITS_VERSION);
                return;
            }
        } else if (!strcmp(tok[0], "region") && ntok == 2) {
            if (tok[1][0] != '/') {
                refuse("%s: region %s is not an absolute path", where, tok[1]);
                return;
            }
            snprintf(limits.region, sizeof limits.region, "%s", tok[1]);
        } else if (!strcmp(tok[0], "elastic") && ntok == 2) {
            limits.elastic = parse_int(tok[1], 0, 1);
            if (limits.elastic < 0) {
                limits.elastic = 0;
                refuse("%s: elastic %s is not 0 or 1", where, tok[1]);
                return;
            }
        } else if (!strcmp(tok[0], "device")) {
            if (parse_device_line(tok, ntok, where)) return;
        } else {
            refuse("%s: unknown line starting with %s", where, tok[0]);
            return;
        }
    }
    if (version != VGPU_LIMITS_VERSION)
        refuse("limits file %s: no `version %d` line", limits_path, VGPU_LIMITS_VERSION);
    else if (!limits.file_devices) refuse("limits file %s: no device lines", limits_path);
}

static void read_environment(void) {
    limits.all = (struct vgpu_quota){.memory = VGPU_UNLIMITED, .cores = 0};
    const char *value = getenv(VGPU_ENV_MEMORY_LIMIT);
    if (value && !(limits.all.memory = parse_bytes(value)))
        refuse(VGPU_ENV_MEMORY_LIMIT "=%s is not a positive number of bytes (suffix k, m or g allowed)",
               value);
    value = getenv(VGPU_ENV_CORES);
    if (value && (limits.all.cores = parse_int(value, 1, VGPU_MAX_CORES)) < 0)
        refuse(VGPU_ENV_CORES "=%s is not in 1..%d", value, VGPU_MAX_CORES);
    for (int i = 0; i < VGPU_MAX_DEVICES; i++) {
        char name[64];
        limits.by_ordinal[i] = (struct vgpu_quota){.memory = 0, .cores = -1};
        snprintf(name, sizeof name, VGPU_ENV_MEMORY_LIMIT "_%d", i);
        if ((value = getenv(name))) {
            limits.has_ordinal_quotas = 1;
            if (!(limits.by_ordinal[i].memory = parse_bytes(value)))
                refuse("%s=%s is not a positive number of bytes (suffix k, m or g allowed)", name, value);
        }
        snprintf(name, sizeof name, VGPU_ENV_CORES "_%d", i);
        if ((value = getenv(name))) {
            limits.has_ordinal_quotas = 1;
            if ((limits.by_ordinal[i].cores = parse_int(value, 1, VGPU_MAX_CORES)) < 0)
                refuse("%s=%s is not in 1..%d", name, value, VGPU_MAX_CORES);
        }
    }
    value = getenv(VGPU_ENV_ELASTIC);
    if (value && (limits.elastic = parse_int(value, 0, 1)) < 0) {
        limits.elastic = 0;
        refuse(VGPU_ENV_ELASTIC "=%s is not 0 or 1", value);
    }
    value = getenv(VGPU_ENV_REGION);
    if (value && snprintf(limits.region, sizeof limits.region, "%s", value) >= (int)sizeof limits.region)
        refuse(VGPU_ENV_REGION "=%s is too long", value);
}

static void load(void) {
    snprintf(limits_path, sizeof limits_path, "%s", VGPU_LIMITS_FILE);
    if (access(VGPU_LIMITS_FILE, F_OK) != 0 && errno == ENOENT) {
        const char *override = getenv(VGPU_ENV_LIMITS_FILE);
        if (!override || !*override) {
            read_environment();
            return;
        }
        snprintf(limits_path, sizeof limits_path, "%s", override);
    }
    limits.from_file = 1;
    FILE *f = fopen(limits_path, "re");
    if (!f) {
        refuse("limits file %s: %s", limits_path, strerror(errno));
        return;
    }
    read_limits_file(f);
    fclose(f);
}

const struct vgpu_limits *vgpu_limits(void) {
    pthread_once(&limits_once, load);
    return &limits;
}

struct vgpu_quota vgpu_quota_of(const char *uuid, int ordinal) {
    const struct vgpu_limits *c = vgpu_limits();
    struct vgpu_quota quota = {.memory = 0, .cores = 0};
    if (c->from_file) {
        for (int i = 0; i < c->file_devices; i++)
            if (!strcmp(c->by_uuid[i].uuid, uuid)) quota = c->by_uuid[i].quota;
    } else {
        quota = c->all;
        if (ordinal >= 0 && ordinal < VGPU_MAX_DEVICES) {
            if (c->by_ordinal[ordinal].memory) quota.memory = c->by_ordinal[ordinal].memory;
            if (c->by_ordinal[ordinal].cores >= 0) quota.cores = c->by_ordinal[ordinal].cores;
        }
    }
    if (c->refuse_memory) quota.memory = 0;
    return quota;
}
