/* nvmlInit/Shutdown (reference counted), system queries, error strings, and the GPU-lost control. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

const struct fg_config *fg_nvml_cfg;
static struct nvmlDevice_st g_devices[FG_MAX_GPUS];
static unsigned g_device_count;
static int g_init_refs;
static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;

static const struct {
    int value;
    const char *name;
    const char *text;
} g_errors[] = {
#include "nvml_errors.inc"
};

/* fork(): a child never inherits a lock held by a thread it does not have. */
static void fork_prepare(void)
{
    pthread_mutex_lock(&g_init_lock);
    fg_shared_fork_lock(1);
}

static void fork_done(void)
{
    fg_shared_fork_lock(0);
    pthread_mutex_unlock(&g_init_lock);
}

__attribute__((constructor)) static void register_fork_handlers(void)
{
    pthread_atfork(fork_prepare, fork_done, fork_done);
}

FG_API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    const struct fg_config *cfg = fg_config();
    if (!cfg)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&g_init_lock);
    if (g_init_refs == 0) {
        for (int i = 0; i < cfg->present_count && rc == NVML_SUCCESS; i++) {
            g_devices[i] = (struct nvmlDevice_st){
                .gpu = cfg->present[i], .index = i, .shared = fg_shared_get(cfg, cfg->present[i])};
            if (!g_devices[i].shared)
                rc = NVML_ERROR_UNKNOWN;
        }
        g_device_count = (unsigned)cfg->present_count;
        fg_nvml_cfg = cfg;
    }
    if (rc == NVML_SUCCESS)
        g_init_refs++;
    pthread_mutex_unlock(&g_init_lock);
    return rc;
}

FG_API nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

FG_API nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

FG_API nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&g_init_lock);
    nvmlReturn_t rc = g_init_refs > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (g_init_refs > 0)
        g_init_refs--;
    pthread_mutex_unlock(&g_init_lock);
    return rc;
}

nvmlReturn_t fg_nvml_check_init(void)
{
    pthread_mutex_lock(&g_init_lock);
    int refs = g_init_refs;
    pthread_mutex_unlock(&g_init_lock);
    return refs > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

void fg_nvml_control_path(const struct fg_gpu_spec *gpu, const char *kind, char *out, size_t size)
{
    snprintf(out, size, "%s/%s.%s", fg_nvml_cfg->state_dir, gpu->uuid, kind);
}

nvmlReturn_t fg_nvml_device(nvmlDevice_t device)
{
    nvmlReturn_t rc = fg_nvml_check_init();
    if (rc != NVML_SUCCESS)
        return rc;
    if (!device || device < g_devices || device >= g_devices + g_device_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    char lost[PATH_MAX + 64];
    fg_nvml_control_path(&fg_nvml_cfg->gpus[device->gpu], "lost", lost, sizeof lost);
    return access(lost, F_OK) == 0 ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

nvmlDevice_t fg_nvml_handle(unsigned index)
{
    return &g_devices[index];
}

unsigned fg_nvml_count(void)
{
    return g_device_count;
}

static nvmlReturn_t copy_string(char *out, unsigned length, const char *text)
{
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(text) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(out, text);
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t rc = fg_nvml_check_init();
    return rc == NVML_SUCCESS ? copy_string(version, length, fg_nvml_cfg->driver_version) : rc;
}

FG_API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    char text[64];
    snprintf(text, sizeof text, "%d.%s", NVML_API_VERSION, fg_config() ? fg_config()->driver_version : "0");
    return copy_string(version, length, text);
}

FG_API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    if (!cudaDriverVersion)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct fg_config *cfg = fg_config();
    if (!cfg)
        return NVML_ERROR_LIBRARY_NOT_FOUND;
    *cudaDriverVersion = cfg->cuda_version;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

FG_API const char *nvmlErrorString(nvmlReturn_t result)
{
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++)
        if (g_errors[i].value == (int)result)
            return g_errors[i].text;
    return "Unknown Error";
}
