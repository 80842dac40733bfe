/* Device queries: count, name, UUID, memory size, attributes, PCI bus id, peers. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

FG_API CUresult cuDeviceGetCount(int *count)
{
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    *count = fg_device_count;
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    struct fg_device *d;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = fg_get_device(ordinal, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    *device = ordinal;
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    struct fg_device *d;
    CUresult rc = fg_get_device(dev, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", fg_spec(dev)->name);
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    struct fg_device *d;
    CUresult rc = fg_get_device(dev, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    memcpy(uuid->bytes, fg_spec(dev)->uuid_bytes, sizeof uuid->bytes);
    return CUDA_SUCCESS;
}

/* The pre-11.4 ABI: same bytes (MIG instances would differ; the fake GPU has none). */
FG_API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    return cuDeviceGetUuid_v2(uuid, dev);
}

FG_API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    struct fg_device *d;
    CUresult rc = fg_get_device(dev, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    *bytes = fg_spec(dev)->memory_bytes;
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev)
{
    struct fg_device *d;
    CUresult rc = fg_get_device(dev, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!major || !minor)
        return CUDA_ERROR_INVALID_VALUE;
    *major = fg_spec(dev)->cc_major;
    *minor = fg_spec(dev)->cc_minor;
    return CUDA_SUCCESS;
}

/* Attributes the fake GPU models from its config, else typical values of a recent data-centre GPU;
 * features it does not model read 0 (unsupported), as a real driver reports them. */
static int attribute_value(const struct fg_gpu_spec *g, CUdevice_attribute attrib)
{
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
        return g->sm_count;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
        return g->cc_major;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
        return g->cc_minor;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID:
        return (int)g->pci_bus;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID:
        return (int)g->pci_device;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID:
        return (int)g->pci_domain;
    case CU_DEVICE_ATTRIBUTE_NUMA_ID:
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID:
        return g->numa_node;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X:
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y:
        return 1024;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z:
        return 64;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X:
        return 2147483647;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y:
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z:
        return 65535;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK:
        return 49152;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN:
        return 232448;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR:
        return 233472;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY:
        return 65536;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE:
        return 32;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH:
        return 2147483647;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK:
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR:
        return 65536;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE:
        return 1755000;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE:
        return 2619000;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH:
        return 5120;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE:
        return 50331648;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT:
    case CU_DEVICE_ATTRIBUTE_SURFACE_ALIGNMENT:
        return 512;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT:
        return 32;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR:
        return 2048;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR:
        return 32;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT:
        return 2;
    case CU_DEVICE_ATTRIBUTE_GPU_OVERLAP:
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY:
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS:
    case CU_DEVICE_ATTRIBUTE_ECC_ENABLED:
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
    case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY:
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS:
    case CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH:
    case CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED:
        return 1;
    case CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES:
        return CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    default:
        return 0;
    }
}

FG_API CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    struct fg_device *d;
    CUresult rc = fg_get_device(dev, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pi || (int)attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    *pi = attribute_value(fg_spec(dev), attrib);
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)
{
    struct fg_device *d;
    CUresult rc = fg_get_device(dev, &d);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!pciBusId || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    fg_format_pci(fg_spec(dev), 4, 0, pciBusId, (unsigned)len);
    return CUDA_SUCCESS;
}

FG_API CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId)
{
    unsigned domain, bus, device;
    CUresult rc = fg_check_init();
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!dev || !pciBusId || fg_parse_pci(pciBusId, &domain, &bus, &device) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < fg_device_count; i++) {
        const struct fg_gpu_spec *g = fg_spec(i);
        if (g->pci_domain == domain && g->pci_bus == bus && g->pci_device == device) {
            *dev = i;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_DEVICE;
}

/* Peers are the GPUs the config connects by NVLink. */
FG_API CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)
{
    struct fg_device *d, *p;
    CUresult rc = fg_get_device(dev, &d);
    if (rc == CUDA_SUCCESS)
        rc = fg_get_device(peerDev, &p);
    if (rc != CUDA_SUCCESS)
        return rc;
    if (!canAccessPeer)
        return CUDA_ERROR_INVALID_VALUE;
    const struct fg_gpu_spec *g = fg_spec(dev);
    *canAccessPeer = 0;
    for (int i = 0; i < g->nvlink_count; i++)
        if (g->nvlink_peer[i] == p->gpu)
            *canAccessPeer = 1;
    return CUDA_SUCCESS;
}
