/* NVML inside the container reports the quota as the GPU's memory, like cuMemGetInfo, so that
 * nvidia-smi and frameworks size themselves to it. */
#include <nvml.h>
#include <string.h>

#include "symbols.h"
#include "vgpu.h"

/* The memory quota and the container's usage of an NVML device; 0 if it has none. */
static int quota_of(nvmlDevice_t device, uint64_t *quota, uint64_t *used) {
    char uuid[VGPU_UUID_LEN];
    if (!REAL(nvmlDeviceGetUUID) || REAL(nvmlDeviceGetUUID)(device, uuid, sizeof uuid) != NVML_SUCCESS) return 0;
    const struct vgpu_limits *c = vgpu_limits();
    int ordinal = !c->from_file && c->has_ordinal_quotas ? vgpu_ordinal_of_uuid(uuid) : -1;
    struct vgpu_quota q = vgpu_quota_of(uuid, ordinal);
    if (q.memory_quota == VGPU_UNLIMITED) return 0;
    int rdev = vgpu_device_join(uuid, q, c->elastic);
    *quota = q.memory_quota;
    *used = vgpu_region_used(rdev);
    if (*used > *quota) *used = *quota;
    return 1;
}

VGPU_API nvmlReturn_t DECLDIR nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    if (!REAL(nvmlDeviceGetMemoryInfo)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t r = REAL(nvmlDeviceGetMemoryInfo)(device, memory);
    uint64_t quota, used;
    if (r == NVML_SUCCESS && memory && quota_of(device, &quota, &used)) {
        memory->total = quota;
        memory->used = used;
        memory->free = quota - used;
    }
    return r;
}

VGPU_API nvmlReturn_t DECLDIR nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    if (!REAL(nvmlDeviceGetMemoryInfo_v2)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlReturn_t r = REAL(nvmlDeviceGetMemoryInfo_v2)(device, memory);
    uint64_t quota, used;
    if (r == NVML_SUCCESS && memory && quota_of(device, &quota, &used)) {
        memory->total = quota;
        memory->reserved = 0;
        memory->used = used;
        memory->free = quota - used;
    }
    return r;
}
