/* Device handles and static device properties: name, UUID, PCI, memory, SMs, NUMA, NVLink. */
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "internal.h"

static const struct fg_gpu_spec *spec(nvmlDevice_t device)
{
    return &fg_nvml_cfg->gpus[device->gpu];
}

FG_API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    nvmlReturn_t rc = fg_nvml_check_init();
    if (rc != NVML_SUCCESS)
        return rc;
    if (!deviceCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = fg_nvml_count();
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

/* Returns the handle only if the GPU answers; a lost GPU reports GPU_IS_LOST, like the real one. */
static nvmlReturn_t hand_out(nvmlDevice_t handle, nvmlDevice_t *device)
{
    nvmlReturn_t rc = fg_nvml_device(handle);
    if (rc == NVML_SUCCESS)
        *device = handle;
    return rc;
}

FG_API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t rc = fg_nvml_check_init();
    if (rc != NVML_SUCCESS)
        return rc;
    if (!device || index >= fg_nvml_count())
        return NVML_ERROR_INVALID_ARGUMENT;
    return hand_out(fg_nvml_handle(index), device);
}

FG_API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

FG_API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    nvmlReturn_t rc = fg_nvml_check_init();
    if (rc != NVML_SUCCESS)
        return rc;
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < fg_nvml_count(); i++)
        if (strcasecmp(spec(fg_nvml_handle(i))->uuid, uuid) == 0)
            return hand_out(fg_nvml_handle(i), device);
    return NVML_ERROR_NOT_FOUND;
}

FG_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    unsigned domain, bus, dev;
    nvmlReturn_t rc = fg_nvml_check_init();
    if (rc != NVML_SUCCESS)
        return rc;
    if (!pciBusId || !device || fg_parse_pci(pciBusId, &domain, &bus, &dev) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < fg_nvml_count(); i++) {
        const struct fg_gpu_spec *g = spec(fg_nvml_handle(i));
        if (g->pci_domain == domain && g->pci_bus == bus && g->pci_device == dev)
            return hand_out(fg_nvml_handle(i), device);
    }
    return NVML_ERROR_NOT_FOUND;
}

FG_API nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
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

FG_API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    nvmlReturn_t rc = fg_nvml_device(device);
    return rc == NVML_SUCCESS ? copy_string(name, length, spec(device)->name) : rc;
}

FG_API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    nvmlReturn_t rc = fg_nvml_device(device);
    return rc == NVML_SUCCESS ? copy_string(uuid, length, spec(device)->uuid) : rc;
}

FG_API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    nvmlReturn_t rc = fg_nvml_device(device);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!index)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned)device->index;
    return NVML_SUCCESS;
}

/* The minor number of /dev/nvidia<N>: the GPU's position in the config, whatever the runtime exposes. */
FG_API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    nvmlReturn_t rc = fg_nvml_device(device);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!minorNumber)
        return NVML_ERROR_INVALID_ARGUMENT;
    *minorNumber = (unsigned)device->gpu;
    return NVML_SUCCESS;
}

static void fill_pci(const struct fg_gpu_spec *g, nvmlPciInfo_t *pci)
{
    memset(pci, 0, sizeof *pci);
    fg_format_pci(g, 4, 1, pci->busIdLegacy, sizeof pci->busIdLegacy);
    fg_format_pci(g, 8, 1, pci->busId, sizeof pci->busId);
    pci->domain = g->pci_domain;
    pci->bus = g->pci_bus;
    pci->device = g->pci_device;
    pci->pciDeviceId = g->pci_device_id;
}

FG_API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    nvmlReturn_t rc = fg_nvml_device(device);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    fill_pci(spec(device), pci);
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

FG_API nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

static nvmlReturn_t memory_of(nvmlDevice_t device, unsigned long long *total, unsigned long long *used)
{
    nvmlReturn_t rc = fg_nvml_device(device);
    if (rc != NVML_SUCCESS)
        return rc;
    *total = spec(device)->memory_bytes;
    *used = fg_mem_used(device->shared);
    if (*used > *total)
        *used = *total;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    unsigned long long total, used;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = memory_of(device, &total, &used);
    if (rc == NVML_SUCCESS)
        *memory = (nvmlMemory_t){.total = total, .free = total - used, .used = used};
    return rc;
}

FG_API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    unsigned long long total, used;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlReturn_t rc = memory_of(device, &total, &used);
    if (rc == NVML_SUCCESS)
        *memory = (nvmlMemory_v2_t){
            .version = nvmlMemory_v2, .total = total, .reserved = 0, .free = total - used, .used = used};
    return rc;
}

FG_API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    nvmlReturn_t rc = fg_nvml_device(device);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!major || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = spec(device)->cc_major;
    *minor = spec(device)->cc_minor;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    nvmlReturn_t rc = fg_nvml_device(device);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!attributes)
        return NVML_ERROR_INVALID_ARGUMENT;
    *attributes = (nvmlDeviceAttributes_t){.multiprocessorCount = (unsigned)spec(device)->sm_count,
                                           .sharedCopyEngineCount = 2,
                                           .memorySizeMB = spec(device)->memory_bytes >> 20};
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetAttributes(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    return nvmlDeviceGetAttributes_v2(device, attributes);
}

FG_API nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node)
{
    nvmlReturn_t rc = fg_nvml_device(device);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!node)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (spec(device)->numa_node < 0)
        return NVML_ERROR_NOT_SUPPORTED;
    *node = (unsigned)spec(device)->numa_node;
    return NVML_SUCCESS;
}

/* Links 0..n-1 connect to the configured peers; a GPU configured without NVLink has none. */
static nvmlReturn_t check_link(nvmlDevice_t device, unsigned link)
{
    nvmlReturn_t rc = fg_nvml_device(device);
    if (rc != NVML_SUCCESS)
        return rc;
    if (spec(device)->nvlink_count == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    return link < NVML_NVLINK_MAX_LINKS ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

FG_API nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive)
{
    nvmlReturn_t rc = check_link(device, link);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!isActive)
        return NVML_ERROR_INVALID_ARGUMENT;
    *isActive = (int)link < spec(device)->nvlink_count ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    nvmlReturn_t rc = check_link(device, link);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!pci || (int)link >= spec(device)->nvlink_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    fill_pci(&fg_nvml_cfg->gpus[spec(device)->nvlink_peer[link]], pci);
    return NVML_SUCCESS;
}

FG_API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetNvLinkRemotePciInfo_v2(device, link, pci);
}
