/* XID events. A test appends "<xid>\n" lines to <state>/<uuid>.xid (fakegpu.inject_xid);
 * an event set delivers the lines written after a device was registered with it. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#define FG_EVENT_MAGIC 0x45565331u
#define FG_EVENT_POLL_NS 5000000ULL

struct fg_registration {
    nvmlDevice_t device;
    unsigned long long types;
    off_t offset; /* bytes of the xid file already delivered */
};

struct nvmlEventSet_st {
    uint32_t magic;
    pthread_mutex_t lock;
    int count;
    struct fg_registration regs[FG_MAX_GPUS];
};

static off_t file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? st.st_size : 0;
}

static void xid_path(nvmlDevice_t device, char *out, size_t size)
{
    fg_nvml_control_path(&fg_nvml_cfg->gpus[device->gpu], "xid", out, size);
}

static nvmlReturn_t check_set(nvmlEventSet_t set)
{
    nvmlReturn_t rc = fg_nvml_check_init();
    if (rc != NVML_SUCCESS)
        return rc;
    return set && set->magic == FG_EVENT_MAGIC ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

FG_API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    nvmlReturn_t rc = fg_nvml_check_init();
    if (rc != NVML_SUCCESS)
        return rc;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct nvmlEventSet_st *s = calloc(1, sizeof *s);
    if (!s)
        return NVML_ERROR_MEMORY;
    s->magic = FG_EVENT_MAGIC;
    pthread_mutex_init(&s->lock, NULL);
    *set = s;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    nvmlReturn_t rc = check_set(set);
    if (rc != NVML_SUCCESS)
        return rc;
    set->magic = 0;
    pthread_mutex_destroy(&set->lock);
    free(set);
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    nvmlReturn_t rc = fg_nvml_device(device);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!eventTypes)
        return NVML_ERROR_INVALID_ARGUMENT;
    *eventTypes = nvmlEventTypeXidCriticalError;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
{
    nvmlReturn_t rc = check_set(set);
    if (rc == NVML_SUCCESS)
        rc = fg_nvml_device(device);
    if (rc != NVML_SUCCESS)
        return rc;
    if (eventTypes & ~(unsigned long long)nvmlEventTypeXidCriticalError)
        return NVML_ERROR_NOT_SUPPORTED;
    char path[PATH_MAX + 64];
    xid_path(device, path, sizeof path);
    pthread_mutex_lock(&set->lock);
    int i = 0;
    while (i < set->count && set->regs[i].device != device)
        i++;
    if (i == set->count) {
        set->regs[i] = (struct fg_registration){.device = device, .offset = file_size(path)};
        set->count++;
    }
    set->regs[i].types |= eventTypes;
    pthread_mutex_unlock(&set->lock);
    return NVML_SUCCESS;
}

/* Reads the next complete line of a registration's xid file; 1 and the xid if there is one. */
static int next_xid(struct fg_registration *r, unsigned long long *xid)
{
    char path[PATH_MAX + 64], line[64];
    xid_path(r->device, path, sizeof path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = pread(fd, line, sizeof line - 1, r->offset);
    close(fd);
    if (n <= 0)
        return 0;
    line[n] = '\0';
    char *end = memchr(line, '\n', (size_t)n);
    if (!end)
        return 0; /* a line still being written */
    *end = '\0';
    r->offset += end - line + 1;
    char *tail;
    errno = 0;
    *xid = strtoull(line, &tail, 10);
    if (errno || *tail || tail == line)
        *xid = 999; /* NVML's value for an unknown xid */
    return 1;
}

FG_API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    nvmlReturn_t rc = check_set(set);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!data)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t deadline = fg_now_ns() + (uint64_t)timeoutms * 1000000ULL;
    for (;;) {
        pthread_mutex_lock(&set->lock);
        for (int i = 0; i < set->count; i++) {
            unsigned long long xid;
            if ((set->regs[i].types & nvmlEventTypeXidCriticalError) && next_xid(&set->regs[i], &xid)) {
                *data = (nvmlEventData_t){.device = set->regs[i].device,
                                          .eventType = nvmlEventTypeXidCriticalError,
                                          .eventData = xid,
                                          .gpuInstanceId = 0xFFFFFFFFu,
                                          .computeInstanceId = 0xFFFFFFFFu};
                pthread_mutex_unlock(&set->lock);
                return NVML_SUCCESS;
            }
        }
        pthread_mutex_unlock(&set->lock);
        uint64_t now = fg_now_ns();
        if (now >= deadline)
            return NVML_ERROR_TIMEOUT;
        uint64_t next = now + FG_EVENT_POLL_NS;
        fg_sleep_until(next < deadline ? next : deadline);
    }
}

FG_API nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return nvmlEventSetWait_v2(set, data, timeoutms);
}
