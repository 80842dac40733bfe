/* Utilization and running processes, derived from the device timeline and memory usage that every
 * process using the fake GPU shares. */
#include <time.h>

#include "internal.h"

#define FG_MAX_PIDS 256

static unsigned percent(uint64_t part, uint64_t whole)
{
    if (whole == 0)
        return 0;
    uint64_t p = (part * 100 + whole / 2) / whole;
    return p > 100 ? 100 : (unsigned)p;
}

static uint64_t window_ns(void)
{
    return (uint64_t)fg_nvml_cfg->util_window_ms * 1000000ULL;
}

/* GPU: share of the last sample window with a kernel running; memory: the same share, since the
 * fake GPU's kernels are modelled as streaming through memory all the time they run. */
FG_API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    nvmlReturn_t rc = fg_nvml_device(device);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!utilization)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t now = fg_now_ns(), from = now - window_ns(), covered;
    uint64_t busy = fg_timeline_busy(device->shared, from, now, 0, &covered);
    unsigned p = percent(busy, now - covered);
    *utilization = (nvmlUtilization_t){.gpu = p, .memory = p};
    return NVML_SUCCESS;
}

static uint64_t realtime_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000ULL + (uint64_t)ts.tv_nsec / 1000ULL;
}

/* One sample per process that ran kernels since lastSeenTimeStamp (CPU time, microseconds), within
 * the last sample window at most. */
FG_API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                                    unsigned int *processSamplesCount,
                                                    unsigned long long lastSeenTimeStamp)
{
    nvmlReturn_t rc = fg_nvml_device(device);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!processSamplesCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t now = fg_now_ns(), now_us = realtime_us();
    uint64_t from = now - window_ns();
    if (lastSeenTimeStamp && lastSeenTimeStamp < now_us && (now_us - lastSeenTimeStamp) * 1000ULL < window_ns())
        from = now - (now_us - lastSeenTimeStamp) * 1000ULL;
    struct fg_owner owners[FG_MAX_PIDS];
    int n = fg_timeline_owners(device->shared, from, now, owners, FG_MAX_PIDS);
    if (n > FG_MAX_PIDS)
        n = FG_MAX_PIDS;
    if (n == 0)
        return NVML_ERROR_NOT_FOUND;
    if (!utilization || *processSamplesCount < (unsigned)n) {
        *processSamplesCount = (unsigned)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < n; i++) {
        uint64_t covered;
        uint64_t busy = fg_timeline_busy(device->shared, from, now, owners[i].owner, &covered);
        unsigned p = percent(busy, now - covered);
        utilization[i] = (nvmlProcessUtilizationSample_t){
            .pid = fg_visible_pid(owners[i].pid), .timeStamp = now_us, .smUtil = p, .memUtil = p};
    }
    *processSamplesCount = (unsigned)n;
    return NVML_SUCCESS;
}

static nvmlReturn_t running(nvmlDevice_t device, unsigned int *infoCount, struct fg_proc_info *procs, int *n)
{
    nvmlReturn_t rc = fg_nvml_device(device);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!infoCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    *n = fg_procs(device->shared, procs, FG_MAX_PIDS);
    if (*n > FG_MAX_PIDS)
        *n = FG_MAX_PIDS;
    if (*infoCount < (unsigned)*n) {
        *infoCount = (unsigned)*n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *infoCount = (unsigned)*n;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos)
{
    struct fg_proc_info procs[FG_MAX_PIDS];
    int n;
    nvmlReturn_t rc = running(device, infoCount, procs, &n);
    if (rc != NVML_SUCCESS)
        return rc;
    if (n > 0 && !infos)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < n; i++)
        infos[i] = (nvmlProcessInfo_t){.pid = fg_visible_pid(procs[i].pid),
                                       .usedGpuMemory = procs[i].mem_used,
                                       .gpuInstanceId = 0xFFFFFFFFu,
                                       .computeInstanceId = 0xFFFFFFFFu};
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                            nvmlProcessInfo_v2_t *infos)
{
    return nvmlDeviceGetComputeRunningProcesses_v3(device, infoCount, infos);
}

FG_API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_v1_t *infos)
{
    struct fg_proc_info procs[FG_MAX_PIDS];
    int n;
    nvmlReturn_t rc = running(device, infoCount, procs, &n);
    if (rc != NVML_SUCCESS)
        return rc;
    if (n > 0 && !infos)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < n; i++)
        infos[i] = (nvmlProcessInfo_v1_t){.pid = fg_visible_pid(procs[i].pid), .usedGpuMemory = procs[i].mem_used};
    return NVML_SUCCESS;
}
