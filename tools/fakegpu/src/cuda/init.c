/* cuInit, the driver version and device enumeration under CUDA_VISIBLE_DEVICES. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

const struct fg_config *fg_cfg;
int fg_device_count;
struct fg_device fg_devices[FG_MAX_GPUS];
pthread_mutex_t fg_lock = PTHREAD_MUTEX_INITIALIZER;

static pthread_once_t g_init_once = PTHREAD_ONCE_INIT;
static CUresult g_init_result = CUDA_ERROR_NOT_INITIALIZED;
static int g_initialized;

/* Like the real driver: entries are indices into the GPUs the container has, or UUID prefixes; the
 * list ends at the first entry that names no GPU or repeats one. An empty variable hides every GPU. */
static void apply_cuda_visible_devices(const struct fg_config *cfg, int *visible, int *count)
{
    const char *env = getenv("CUDA_VISIBLE_DEVICES");
    *count = 0;
    if (!env) {
        memcpy(visible, cfg->present, sizeof(int) * (size_t)cfg->present_count);
        *count = cfg->present_count;
        return;
    }
    char list[1024];
    snprintf(list, sizeof list, "%s", env);
    char *save = NULL;
    for (char *id = strtok_r(list, ",", &save); id && *count < FG_MAX_GPUS; id = strtok_r(NULL, ",", &save)) {
        while (isspace((unsigned char)*id))
            id++;
        char *end = id + strlen(id);
        while (end > id && isspace((unsigned char)end[-1]))
            *--end = '\0';
        int g = fg_config_find_gpu(cfg, cfg->present, cfg->present_count, id);
        if (g < 0)
            return;
        for (int i = 0; i < *count; i++)
            if (visible[i] == g)
                return;
        visible[(*count)++] = g;
    }
}

static void init_once(void)
{
    const struct fg_config *cfg = fg_config();
    if (!cfg) {
        g_init_result = CUDA_ERROR_NO_DEVICE;
        return;
    }
    int visible[FG_MAX_GPUS];
    int count;
    apply_cuda_visible_devices(cfg, visible, &count);
    if (count == 0) {
        g_init_result = CUDA_ERROR_NO_DEVICE;
        return;
    }
    for (int i = 0; i < count; i++) {
        struct fg_device *d = &fg_devices[i];
        d->gpu = visible[i];
        d->shared = fg_shared_get(cfg, visible[i]);
        if (!d->shared) {
            g_init_result = CUDA_ERROR_OPERATING_SYSTEM;
            return;
        }
        fg_ctx_init(&d->primary, i, 0, 1);
        d->primary.magic = 0; /* inactive until retained */
        d->default_pool = (struct CUmemPoolHandle_st){
            .magic = FG_MAGIC_POOL,
            .dev = i,
            .props = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = i}},
        };
        d->current_pool = &d->default_pool;
    }
    fg_cfg = cfg;
    fg_device_count = count;
    g_init_result = CUDA_SUCCESS;
    __atomic_store_n(&g_initialized, 1, __ATOMIC_RELEASE);
}

FG_API CUresult cuInit(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&g_init_once, init_once);
    return g_init_result;
}

CUresult fg_check_init(void)
{
    /* Set once, with release order after every device is ready: an acquire load that sees 1 sees
     * them too; a thread that races cuInit sees NOT_INITIALIZED, as with the real driver. */
    return __atomic_load_n(&g_initialized, __ATOMIC_ACQUIRE) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

CUresult fg_get_device(CUdevice dev, struct fg_device **out)
{
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (dev < 0 || dev >= fg_device_count)
        return CUDA_ERROR_INVALID_DEVICE;
    *out = &fg_devices[dev];
    return CUDA_SUCCESS;
}

const struct fg_gpu_spec *fg_spec(CUdevice dev)
{
    return &fg_cfg->gpus[fg_devices[dev].gpu];
}

FG_API CUresult cuDriverGetVersion(int *driverVersion)
{
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    const struct fg_config *cfg = fg_config();
    *driverVersion = cfg ? cfg->cuda_version : CUDA_VERSION;
    return CUDA_SUCCESS;
}
