/* Reads the fake GPUs' description (docs/fakegpu.md). Errors name the file, line, field and value. */
#include "config.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define FG_DEFAULT_DRIVER_VERSION "580.95.05"
#define FG_DEFAULT_CUDA_VERSION 13000
#define FG_DEFAULT_UTIL_WINDOW_MS 200
/* Calibrated to an H200 with driver 580 at its default time slice (docs/fakegpu.md, "Time model"). */
#define FG_DEFAULT_TIMESLICE_US 1200
#define FG_DEFAULT_SWITCH_US 100

static struct fg_config g_config;
static int g_config_ok;
static pthread_once_t g_config_once = PTHREAD_ONCE_INIT;

static int config_error(const char *path, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int config_error(const char *path, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (line > 0)
        fprintf(stderr, "fakegpu: %s:%d: ", path, line);
    else
        fprintf(stderr, "fakegpu: %s: ", path);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return -1;
}

/* Decimal, or hexadecimal with 0x where `base` is 0. */
static int parse_u64(const char *text, int base, uint64_t *out)
{
    char *end;
    if (!isdigit((unsigned char)text[0]))
        return -1;
    errno = 0;
    unsigned long long v = strtoull(text, &end, base);
    if (errno || *end)
        return -1;
    *out = v;
    return 0;
}

static int parse_memory(const char *text, uint64_t *out)
{
    static const struct {
        const char *suffix;
        uint64_t factor;
    } units[] = {{"KiB", 1ULL << 10}, {"MiB", 1ULL << 20}, {"GiB", 1ULL << 30}, {"TiB", 1ULL << 40}};
    char *end;
    if (!isdigit((unsigned char)text[0]))
        return -1;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno || v == 0)
        return -1;
    if (*end == '\0') {
        *out = v;
        return 0;
    }
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcmp(end, units[i].suffix) == 0) {
            if (v > UINT64_MAX / units[i].factor)
                return -1;
            *out = v * units[i].factor;
            return 0;
        }
    }
    return -1;
}

static int hex_value(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    c = (char)tolower((unsigned char)c);
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
static int parse_uuid(const char *text, unsigned char bytes[16])
{
    static const int dash_at[] = {8, 13, 18, 23};
    if (strncmp(text, "GPU-", 4) != 0 || strlen(text) != FG_UUID_LEN)
        return -1;
    const char *hex = text + 4;
    int n = 0;
    for (int i = 0; i < 36; i++) {
        int is_dash_pos = i == dash_at[0] || i == dash_at[1] || i == dash_at[2] || i == dash_at[3];
        if (is_dash_pos) {
            if (hex[i] != '-')
                return -1;
            continue;
        }
        int hi = hex_value(hex[i]), lo = hex_value(hex[i + 1]);
        if (hi < 0 || lo < 0)
            return -1;
        bytes[n++] = (unsigned char)(hi << 4 | lo);
        i++;
    }
    return n == 16 ? 0 : -1;
}

int fg_parse_pci(const char *text, unsigned *domain, unsigned *bus, unsigned *device)
{
    unsigned d = 0, b, dev, fn;
    char tail;
    if (sscanf(text, "%x:%x:%x.%x%c", &d, &b, &dev, &fn, &tail) == 4) {
    } else if (sscanf(text, "%x:%x.%x%c", &b, &dev, &fn, &tail) == 3) {
        d = 0;
    } else {
        return -1;
    }
    if (b > 0xff || dev > 0x1f || fn > 7)
        return -1;
    *domain = d;
    *bus = b;
    *device = dev;
    return 0;
}

void fg_format_pci(const struct fg_gpu_spec *gpu, int domain_width, int upper, char *out, unsigned size)
{
    snprintf(out, size, upper ? "%0*X:%02X:%02X.0" : "%0*x:%02x:%02x.0", domain_width, gpu->pci_domain,
             gpu->pci_bus, gpu->pci_device);
}

/* Splits the next `key=value` token off *cursor; values may be double-quoted. 1: token, 0: end, -1: bad. */
static int next_pair(char **cursor, char **key, char **value)
{
    char *p = *cursor;
    while (*p && isspace((unsigned char)*p))
        p++;
    if (!*p)
        return 0;
    *key = p;
    while (*p && *p != '=' && !isspace((unsigned char)*p))
        p++;
    if (*p != '=')
        return -1;
    *p++ = '\0';
    if (*p == '"') {
        *value = ++p;
        while (*p && *p != '"')
            p++;
        if (*p != '"')
            return -1;
        *p++ = '\0';
    } else {
        *value = p;
        while (*p && !isspace((unsigned char)*p))
            p++;
        if (*p)
            *p++ = '\0';
    }
    *cursor = p;
    return 1;
}

/* The scheduler fields, on a gpu or the driver line: 1 if `key` is one (then *rc says if its value
 * was good), 0 if not. */
static int parse_sched_field(const char *path, int line, const char *key, const char *value, int64_t *timeslice_us,
                             int64_t *switch_us, int *rc)
{
    uint64_t n;
    *rc = 0;
    if (strcmp(key, "timeslice_us") == 0) {
        if (parse_u64(value, 10, &n) != 0 || n < 1 || n > 10000000)
            *rc = config_error(path, line, "field 'timeslice_us': bad value '%s' (want 1 to 10000000)", value);
        else
            *timeslice_us = (int64_t)n;
        return 1;
    }
    if (strcmp(key, "switch_us") == 0) {
        if (parse_u64(value, 10, &n) != 0 || n > 1000000)
            *rc = config_error(path, line, "field 'switch_us': bad value '%s' (want 0 to 1000000)", value);
        else
            *switch_us = (int64_t)n;
        return 1;
    }
    return 0;
}

struct pending_nvlinks {
    char peers[FG_MAX_GPUS][512];
    int line[FG_MAX_GPUS];
};

/* Bits of `seen`, in the order of the required fields checked by parse_gpu_line. */
enum { SEEN_NAME = 1, SEEN_UUID = 2, SEEN_MEMORY = 4, SEEN_SMS = 8, SEEN_CC = 16, SEEN_PCI = 32 };

static int parse_gpu_field(struct fg_config *cfg, struct fg_gpu_spec *gpu, struct pending_nvlinks *links,
                           int line, const char *key, const char *value, unsigned *seen)
{
    const char *path = cfg->path;
    int idx = (int)(gpu - cfg->gpus);
    uint64_t n;
    int rc;
    if (parse_sched_field(path, line, key, value, &gpu->timeslice_us, &gpu->switch_us, &rc))
        return rc;
    if (strcmp(key, "name") == 0) {
        *seen |= SEEN_NAME;
        if (!*value || strlen(value) >= sizeof gpu->name)
            return config_error(path, line, "field 'name': bad value '%s' (1 to %zu characters)", value,
                                sizeof gpu->name - 1);
        strcpy(gpu->name, value);
    } else if (strcmp(key, "uuid") == 0) {
        *seen |= SEEN_UUID;
        if (parse_uuid(value, gpu->uuid_bytes) != 0)
            return config_error(path, line,
                                "field 'uuid': bad value '%s' (want GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)",
                                value);
        strcpy(gpu->uuid, value);
    } else if (strcmp(key, "memory") == 0) {
        *seen |= SEEN_MEMORY;
        if (parse_memory(value, &gpu->memory_bytes) != 0)
            return config_error(path, line,
                                "field 'memory': bad value '%s' (want bytes, or a number with KiB, MiB, GiB, TiB)",
                                value);
    } else if (strcmp(key, "sms") == 0) {
        *seen |= SEEN_SMS;
        if (parse_u64(value, 10, &n) != 0 || n == 0 || n > 100000)
            return config_error(path, line, "field 'sms': bad value '%s' (want 1 to 100000)", value);
        gpu->sm_count = (int)n;
    } else if (strcmp(key, "cc") == 0) {
        *seen |= SEEN_CC;
        int major, minor;
        char tail;
        if (sscanf(value, "%d.%d%c", &major, &minor, &tail) != 2 || major < 1 || major > 99 || minor < 0 ||
            minor > 9)
            return config_error(path, line, "field 'cc': bad value '%s' (want major.minor, e.g. 8.0)", value);
        gpu->cc_major = major;
        gpu->cc_minor = minor;
    } else if (strcmp(key, "pci") == 0) {
        *seen |= SEEN_PCI;
        if (fg_parse_pci(value, &gpu->pci_domain, &gpu->pci_bus, &gpu->pci_device) != 0)
            return config_error(path, line, "field 'pci': bad value '%s' (want dddd:bb:dd.f)", value);
    } else if (strcmp(key, "pci_device_id") == 0) {
        if (parse_u64(value, 0, &n) != 0 || n > 0xffffffffULL)
            return config_error(path, line, "field 'pci_device_id': bad value '%s' (want a 32-bit number)",
                                value);
        gpu->pci_device_id = (unsigned)n;
    } else if (strcmp(key, "numa") == 0) {
        if (parse_u64(value, 10, &n) != 0 || n > 1023)
            return config_error(path, line, "field 'numa': bad value '%s' (want 0 to 1023)", value);
        gpu->numa_node = (int)n;
    } else if (strcmp(key, "nvlink") == 0) {
        if (strlen(value) >= sizeof links->peers[idx])
            return config_error(path, line, "field 'nvlink': value too long");
        strcpy(links->peers[idx], value);
        links->line[idx] = line;
    } else {
        return config_error(path, line, "unknown gpu field '%s'", key);
    }
    return 0;
}

static int parse_gpu_line(struct fg_config *cfg, struct pending_nvlinks *links, int line, char *rest)
{
    if (cfg->gpu_count == FG_MAX_GPUS)
        return config_error(cfg->path, line, "more than %d gpus", FG_MAX_GPUS);
    struct fg_gpu_spec *gpu = &cfg->gpus[cfg->gpu_count];
    memset(gpu, 0, sizeof *gpu);
    gpu->numa_node = -1;
    gpu->timeslice_us = -1;
    gpu->switch_us = -1;
    gpu->pci_device_id = 0x10de; /* NVIDIA's vendor id, device id 0 unless configured */
    char *key, *value;
    int r;
    unsigned seen = 0;
    while ((r = next_pair(&rest, &key, &value)) == 1) {
        if (parse_gpu_field(cfg, gpu, links, line, key, value, &seen) != 0)
            return -1;
    }
    if (r < 0)
        return config_error(cfg->path, line, "expected key=value pairs near '%s'", rest);
    static const char *required[] = {"name", "uuid", "memory", "sms", "cc", "pci"};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
        if (!(seen & (1u << i)))
            return config_error(cfg->path, line, "gpu is missing field '%s'", required[i]);
    for (int i = 0; i < cfg->gpu_count; i++) {
        if (strcmp(cfg->gpus[i].uuid, gpu->uuid) == 0)
            return config_error(cfg->path, line, "field 'uuid': '%s' is used twice", gpu->uuid);
        if (cfg->gpus[i].pci_domain == gpu->pci_domain && cfg->gpus[i].pci_bus == gpu->pci_bus &&
            cfg->gpus[i].pci_device == gpu->pci_device)
            return config_error(cfg->path, line, "field 'pci': bus id is used twice");
    }
    cfg->gpu_count++;
    return 0;
}

static int parse_driver_line(struct fg_config *cfg, int line, char *rest)
{
    char *key, *value;
    int r;
    uint64_t n;
    int rc;
    while ((r = next_pair(&rest, &key, &value)) == 1) {
        if (parse_sched_field(cfg->path, line, key, value, &cfg->timeslice_us, &cfg->switch_us, &rc)) {
            if (rc != 0)
                return rc;
        } else if (strcmp(key, "version") == 0) {
            if (!*value || strlen(value) >= sizeof cfg->driver_version)
                return config_error(cfg->path, line, "field 'version': bad value '%s'", value);
            strcpy(cfg->driver_version, value);
        } else if (strcmp(key, "cuda") == 0) {
            if (parse_u64(value, 10, &n) != 0 || n < 1000 || n > 99999)
                return config_error(cfg->path, line, "field 'cuda': bad value '%s' (want e.g. 13000)", value);
            cfg->cuda_version = (int)n;
        } else if (strcmp(key, "util_window_ms") == 0) {
            if (parse_u64(value, 10, &n) != 0 || n < 10 || n > 10000)
                return config_error(cfg->path, line, "field 'util_window_ms': bad value '%s' (want 10 to 10000)",
                                    value);
            cfg->util_window_ms = (unsigned)n;
        } else {
            return config_error(cfg->path, line, "unknown driver field '%s'", key);
        }
    }
    if (r < 0)
        return config_error(cfg->path, line, "expected key=value pairs near '%s'", rest);
    return 0;
}

static int resolve_nvlinks(struct fg_config *cfg, struct pending_nvlinks *links)
{
    for (int i = 0; i < cfg->gpu_count; i++) {
        char *save = NULL;
        for (char *peer = strtok_r(links->peers[i], ",", &save); peer; peer = strtok_r(NULL, ",", &save)) {
            int found = -1;
            for (int j = 0; j < cfg->gpu_count; j++)
                if (j != i && strcmp(cfg->gpus[j].uuid, peer) == 0)
                    found = j;
            if (found < 0)
                return config_error(cfg->path, links->line[i],
                                    "field 'nvlink': bad value '%s' (not the uuid of another gpu)", peer);
            if (cfg->gpus[i].nvlink_count == FG_MAX_NVLINKS)
                return config_error(cfg->path, links->line[i], "field 'nvlink': more than %d links",
                                    FG_MAX_NVLINKS);
            cfg->gpus[i].nvlink_peer[cfg->gpus[i].nvlink_count++] = found;
        }
    }
    return 0;
}

static int parse_file(struct fg_config *cfg)
{
    FILE *f = fopen(cfg->path, "r");
    if (!f)
        return config_error(cfg->path, 0, "cannot open FAKEGPU_CONFIG: %s", strerror(errno));
    static struct pending_nvlinks links;
    memset(&links, 0, sizeof links);
    char buf[4096];
    int line = 0, rc = 0;
    while (rc == 0 && fgets(buf, sizeof buf, f)) {
        line++;
        buf[strcspn(buf, "\r\n")] = '\0';
        char *p = buf;
        while (isspace((unsigned char)*p))
            p++;
        if (*p == '\0' || *p == '#')
            continue;
        if (strncmp(p, "gpu", 3) == 0 && (p[3] == '\0' || isspace((unsigned char)p[3])))
            rc = parse_gpu_line(cfg, &links, line, p + 3);
        else if (strncmp(p, "driver", 6) == 0 && (p[6] == '\0' || isspace((unsigned char)p[6])))
            rc = parse_driver_line(cfg, line, p + 6);
        else
            rc = config_error(cfg->path, line, "line must start with 'gpu' or 'driver': '%s'", p);
    }
    fclose(f);
    if (rc == 0)
        rc = resolve_nvlinks(cfg, &links);
    for (int i = 0; rc == 0 && i < cfg->gpu_count; i++) {
        if (cfg->gpus[i].timeslice_us < 0)
            cfg->gpus[i].timeslice_us = cfg->timeslice_us;
        if (cfg->gpus[i].switch_us < 0)
            cfg->gpus[i].switch_us = cfg->switch_us;
    }
    return rc;
}

int fg_config_find_gpu(const struct fg_config *cfg, const int *among, int among_count, const char *id)
{
    char *end;
    if (isdigit((unsigned char)id[0])) {
        long v = strtol(id, &end, 10);
        if (*end == '\0')
            return v >= 0 && v < among_count ? among[v] : -1;
    }
    const char *prefix = strncmp(id, "GPU-", 4) == 0 ? id + 4 : id;
    size_t len = strlen(prefix);
    if (len == 0)
        return -1;
    int found = -1;
    for (int i = 0; i < among_count; i++) {
        if (strncasecmp(cfg->gpus[among[i]].uuid + 4, prefix, len) == 0) {
            if (found >= 0)
                return -1;
            found = among[i];
        }
    }
    return found;
}

/* The NVIDIA container toolkit's volume-mounts device list: NVIDIA_VISIBLE_DEVICES names this
 * directory and each GPU is an entry in it (tessera.contract.CONTAINER_DEVICE_LIST_DIR). */
#define DEVICE_LIST_DIR "/var/run/nvidia-container-devices"

static int add_present(struct fg_config *cfg, const int *all, const char *id)
{
    int g = fg_config_find_gpu(cfg, all, cfg->gpu_count, id);
    if (g < 0)
        return config_error(cfg->path, 0, "NVIDIA_VISIBLE_DEVICES: bad value '%s' (no such gpu)", id);
    for (int i = 0; i < cfg->present_count; i++)
        if (cfg->present[i] == g)
            return config_error(cfg->path, 0, "NVIDIA_VISIBLE_DEVICES: gpu '%s' listed twice", id);
    cfg->present[cfg->present_count++] = g;
    return 0;
}

/* Emulates the container runtime: NVIDIA_VISIBLE_DEVICES picks the GPUs a container has at all, as
 * a list of GPUs or as the volume-mounts directory whose entries name them. */
static int apply_runtime_visibility(struct fg_config *cfg)
{
    int all[FG_MAX_GPUS];
    for (int i = 0; i < cfg->gpu_count; i++)
        all[i] = i;
    const char *env = getenv("NVIDIA_VISIBLE_DEVICES");
    cfg->present_count = 0;
    if (!env || !*env || strcmp(env, "all") == 0) {
        memcpy(cfg->present, all, sizeof all);
        cfg->present_count = cfg->gpu_count;
        return 0;
    }
    if (strcmp(env, "none") == 0 || strcmp(env, "void") == 0)
        return 0;
    if (strcmp(env, DEVICE_LIST_DIR) == 0) {
        DIR *dir = opendir(DEVICE_LIST_DIR);
        if (!dir)
            return 0; /* no device mounted: no GPU, as the toolkit gives none */
        int rc = 0;
        for (struct dirent *e; rc == 0 && (e = readdir(dir));)
            if (e->d_name[0] != '.')
                rc = add_present(cfg, all, e->d_name);
        closedir(dir);
        return rc;
    }
    char list[1024];
    snprintf(list, sizeof list, "%s", env);
    char *save = NULL;
    int rc = 0;
    for (char *id = strtok_r(list, ",", &save); id && rc == 0; id = strtok_r(NULL, ",", &save))
        rc = add_present(cfg, all, id);
    return rc;
}

static void load_config(void)
{
    struct fg_config *cfg = &g_config;
    const char *path = getenv("FAKEGPU_CONFIG");
    if (!path || !*path) {
        fprintf(stderr, "fakegpu: FAKEGPU_CONFIG is not set (the file describing the fake GPUs)\n");
        return;
    }
    if (strlen(path) + sizeof ".state" > sizeof cfg->path) {
        fprintf(stderr, "fakegpu: FAKEGPU_CONFIG: path too long\n");
        return;
    }
    strcpy(cfg->path, path);
    strcpy(cfg->driver_version, FG_DEFAULT_DRIVER_VERSION);
    cfg->cuda_version = FG_DEFAULT_CUDA_VERSION;
    cfg->util_window_ms = FG_DEFAULT_UTIL_WINDOW_MS;
    cfg->timeslice_us = FG_DEFAULT_TIMESLICE_US;
    cfg->switch_us = FG_DEFAULT_SWITCH_US;
    if (parse_file(cfg) != 0 || apply_runtime_visibility(cfg) != 0)
        return;
    const char *state = getenv("FAKEGPU_STATE");
    if (state && *state) {
        if (strlen(state) >= sizeof cfg->state_dir) {
            config_error(path, 0, "FAKEGPU_STATE: path too long");
            return;
        }
        strcpy(cfg->state_dir, state);
    } else {
        snprintf(cfg->state_dir, sizeof cfg->state_dir, "%s.state", path);
    }
    if (mkdir(cfg->state_dir, 0777) == 0) {
        chmod(cfg->state_dir, 01777); /* shared by every user of the GPUs, like /tmp */
    } else if (errno != EEXIST) {
        config_error(path, 0, "cannot create state dir '%s': %s", cfg->state_dir, strerror(errno));
        return;
    }
    g_config_ok = 1;
}

const struct fg_config *fg_config(void)
{
    pthread_once(&g_config_once, load_config);
    return g_config_ok ? &g_config : NULL;
}
