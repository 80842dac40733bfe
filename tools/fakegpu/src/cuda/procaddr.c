/* cuGetProcAddress: every entry point by API name and the ABI version it appeared in. A query gets
 * the newest entry not newer than the version asked for (below 3020, cuMemAlloc is the 32-bit ABI),
 * and the per-thread default stream variant when asked for one and one exists. Each entry is
 * checked at compile time against the header's PFN_<name>_v<version>[_ptsz|_ptds] type. */
#include <cudaTypedefs.h>
#include <string.h>

#include "internal.h"

struct fg_proc {
    const char *name;
    int version;
    int per_thread;
    void *fn;
};

/* The table, as an X-macro expanded twice: once into compile-time signature checks, once into data. */
#define FG_PROC_TABLE(E, PTSZ, PTDS) \
    E(cuInit, 2000, cuInit) \
    E(cuDriverGetVersion, 2020, cuDriverGetVersion) \
    E(cuGetErrorName, 6000, cuGetErrorName) \
    E(cuGetErrorString, 6000, cuGetErrorString) \
    E(cuGetProcAddress, 11030, cuGetProcAddress) \
    E(cuGetProcAddress, 12000, cuGetProcAddress_v2) \
    E(cuDeviceGet, 2000, cuDeviceGet) \
    E(cuDeviceGetCount, 2000, cuDeviceGetCount) \
    E(cuDeviceGetName, 2000, cuDeviceGetName) \
    E(cuDeviceGetUuid, 9020, cuDeviceGetUuid) \
    E(cuDeviceGetUuid, 11040, cuDeviceGetUuid_v2) \
    E(cuDeviceTotalMem, 2000, cuDeviceTotalMem) \
    E(cuDeviceTotalMem, 3020, cuDeviceTotalMem_v2) \
    E(cuDeviceGetAttribute, 2000, cuDeviceGetAttribute) \
    E(cuDeviceComputeCapability, 2000, cuDeviceComputeCapability) \
    E(cuDeviceGetPCIBusId, 4010, cuDeviceGetPCIBusId) \
    E(cuDeviceGetByPCIBusId, 4010, cuDeviceGetByPCIBusId) \
    E(cuDeviceCanAccessPeer, 4000, cuDeviceCanAccessPeer) \
    E(cuDevicePrimaryCtxRetain, 7000, cuDevicePrimaryCtxRetain) \
    E(cuDevicePrimaryCtxRelease, 7000, cuDevicePrimaryCtxRelease) \
    E(cuDevicePrimaryCtxRelease, 11000, cuDevicePrimaryCtxRelease_v2) \
    E(cuDevicePrimaryCtxReset, 7000, cuDevicePrimaryCtxReset) \
    E(cuDevicePrimaryCtxReset, 11000, cuDevicePrimaryCtxReset_v2) \
    E(cuDevicePrimaryCtxSetFlags, 7000, cuDevicePrimaryCtxSetFlags) \
    E(cuDevicePrimaryCtxSetFlags, 11000, cuDevicePrimaryCtxSetFlags_v2) \
    E(cuDevicePrimaryCtxGetState, 7000, cuDevicePrimaryCtxGetState) \
    E(cuCtxCreate, 2000, cuCtxCreate) \
    E(cuCtxCreate, 3020, cuCtxCreate_v2) \
    E(cuCtxCreate, 11040, cuCtxCreate_v3) \
    E(cuCtxCreate, 12050, cuCtxCreate_v4) \
    E(cuCtxDestroy, 2000, cuCtxDestroy) \
    E(cuCtxDestroy, 4000, cuCtxDestroy_v2) \
    E(cuCtxPushCurrent, 2000, cuCtxPushCurrent) \
    E(cuCtxPushCurrent, 4000, cuCtxPushCurrent_v2) \
    E(cuCtxPopCurrent, 2000, cuCtxPopCurrent) \
    E(cuCtxPopCurrent, 4000, cuCtxPopCurrent_v2) \
    E(cuCtxSetCurrent, 4000, cuCtxSetCurrent) \
    E(cuCtxGetCurrent, 4000, cuCtxGetCurrent) \
    E(cuCtxGetDevice, 2000, cuCtxGetDevice) \
    E(cuCtxGetDevice, 13000, cuCtxGetDevice_v2) \
    E(cuCtxGetFlags, 7000, cuCtxGetFlags) \
    E(cuCtxSynchronize, 2000, cuCtxSynchronize) \
    E(cuCtxSynchronize, 13000, cuCtxSynchronize_v2) \
    E(cuCtxGetApiVersion, 3020, cuCtxGetApiVersion) \
    E(cuCtxGetStreamPriorityRange, 5050, cuCtxGetStreamPriorityRange) \
    E(cuModuleLoad, 2000, cuModuleLoad) \
    E(cuModuleLoadData, 2000, cuModuleLoadData) \
    E(cuModuleLoadDataEx, 2010, cuModuleLoadDataEx) \
    E(cuModuleLoadFatBinary, 2000, cuModuleLoadFatBinary) \
    E(cuModuleUnload, 2000, cuModuleUnload) \
    E(cuModuleGetFunction, 2000, cuModuleGetFunction) \
    E(cuFuncGetAttribute, 2020, cuFuncGetAttribute) \
    E(cuLibraryLoadData, 12000, cuLibraryLoadData) \
    E(cuLibraryUnload, 12000, cuLibraryUnload) \
    E(cuLibraryGetKernel, 12000, cuLibraryGetKernel) \
    E(cuKernelGetFunction, 12000, cuKernelGetFunction) \
    E(cuMemGetInfo, 2000, cuMemGetInfo) \
    E(cuMemGetInfo, 3020, cuMemGetInfo_v2) \
    E(cuMemAlloc, 2000, cuMemAlloc) \
    E(cuMemAlloc, 3020, cuMemAlloc_v2) \
    E(cuMemAllocPitch, 2000, cuMemAllocPitch) \
    E(cuMemAllocPitch, 3020, cuMemAllocPitch_v2) \
    E(cuMemFree, 2000, cuMemFree) \
    E(cuMemFree, 3020, cuMemFree_v2) \
    E(cuMemGetAddressRange, 3020, cuMemGetAddressRange_v2) \
    E(cuMemAllocHost, 3020, cuMemAllocHost_v2) \
    E(cuMemFreeHost, 2000, cuMemFreeHost) \
    E(cuMemHostAlloc, 2020, cuMemHostAlloc) \
    E(cuMemHostGetDevicePointer, 3020, cuMemHostGetDevicePointer_v2) \
    E(cuMemAllocManaged, 6000, cuMemAllocManaged) \
    E(cuDeviceGetDefaultMemPool, 11020, cuDeviceGetDefaultMemPool) \
    E(cuDeviceGetMemPool, 11020, cuDeviceGetMemPool) \
    E(cuDeviceSetMemPool, 11020, cuDeviceSetMemPool) \
    E(cuMemPoolCreate, 11020, cuMemPoolCreate) \
    E(cuMemPoolDestroy, 11020, cuMemPoolDestroy) \
    E(cuMemPoolGetAttribute, 11020, cuMemPoolGetAttribute) \
    E(cuMemPoolSetAttribute, 11020, cuMemPoolSetAttribute) \
    E(cuMemAllocAsync, 11020, cuMemAllocAsync) \
    PTSZ(cuMemAllocAsync, 11020, cuMemAllocAsync_ptsz) \
    E(cuMemFreeAsync, 11020, cuMemFreeAsync) \
    PTSZ(cuMemFreeAsync, 11020, cuMemFreeAsync_ptsz) \
    E(cuMemAllocFromPoolAsync, 11020, cuMemAllocFromPoolAsync) \
    PTSZ(cuMemAllocFromPoolAsync, 11020, cuMemAllocFromPoolAsync_ptsz) \
    E(cuMemGetAllocationGranularity, 10020, cuMemGetAllocationGranularity) \
    E(cuMemCreate, 10020, cuMemCreate) \
    E(cuMemRelease, 10020, cuMemRelease) \
    E(cuMemAddressReserve, 10020, cuMemAddressReserve) \
    E(cuMemAddressFree, 10020, cuMemAddressFree) \
    E(cuMemMap, 10020, cuMemMap) \
    E(cuMemUnmap, 10020, cuMemUnmap) \
    E(cuMemSetAccess, 10020, cuMemSetAccess) \
    E(cuArrayCreate, 2000, cuArrayCreate) \
    E(cuArrayCreate, 3020, cuArrayCreate_v2) \
    E(cuArray3DCreate, 2000, cuArray3DCreate) \
    E(cuArray3DCreate, 3020, cuArray3DCreate_v2) \
    E(cuArray3DGetDescriptor, 3020, cuArray3DGetDescriptor_v2) \
    E(cuArrayDestroy, 2000, cuArrayDestroy) \
    E(cuMipmappedArrayCreate, 5000, cuMipmappedArrayCreate) \
    E(cuMipmappedArrayDestroy, 5000, cuMipmappedArrayDestroy) \
    E(cuMemcpyHtoD, 2000, cuMemcpyHtoD) \
    E(cuMemcpyHtoD, 3020, cuMemcpyHtoD_v2) \
    PTDS(cuMemcpyHtoD, 7000, cuMemcpyHtoD_v2_ptds) \
    E(cuMemcpyDtoH, 2000, cuMemcpyDtoH) \
    E(cuMemcpyDtoH, 3020, cuMemcpyDtoH_v2) \
    PTDS(cuMemcpyDtoH, 7000, cuMemcpyDtoH_v2_ptds) \
    E(cuMemcpyDtoD, 2000, cuMemcpyDtoD) \
    E(cuMemcpyDtoD, 3020, cuMemcpyDtoD_v2) \
    PTDS(cuMemcpyDtoD, 7000, cuMemcpyDtoD_v2_ptds) \
    E(cuMemcpy, 4000, cuMemcpy) \
    PTDS(cuMemcpy, 7000, cuMemcpy_ptds) \
    E(cuMemcpyHtoDAsync, 3020, cuMemcpyHtoDAsync_v2) \
    PTSZ(cuMemcpyHtoDAsync, 7000, cuMemcpyHtoDAsync_v2_ptsz) \
    E(cuMemcpyDtoHAsync, 3020, cuMemcpyDtoHAsync_v2) \
    PTSZ(cuMemcpyDtoHAsync, 7000, cuMemcpyDtoHAsync_v2_ptsz) \
    E(cuMemcpyDtoDAsync, 3020, cuMemcpyDtoDAsync_v2) \
    PTSZ(cuMemcpyDtoDAsync, 7000, cuMemcpyDtoDAsync_v2_ptsz) \
    E(cuMemcpyAsync, 4000, cuMemcpyAsync) \
    PTSZ(cuMemcpyAsync, 7000, cuMemcpyAsync_ptsz) \
    E(cuMemsetD8, 2000, cuMemsetD8) \
    E(cuMemsetD8, 3020, cuMemsetD8_v2) \
    PTDS(cuMemsetD8, 7000, cuMemsetD8_v2_ptds) \
    E(cuMemsetD16, 3020, cuMemsetD16_v2) \
    PTDS(cuMemsetD16, 7000, cuMemsetD16_v2_ptds) \
    E(cuMemsetD32, 2000, cuMemsetD32) \
    E(cuMemsetD32, 3020, cuMemsetD32_v2) \
    PTDS(cuMemsetD32, 7000, cuMemsetD32_v2_ptds) \
    E(cuMemsetD2D8, 3020, cuMemsetD2D8_v2) \
    E(cuMemsetD2D32, 3020, cuMemsetD2D32_v2) \
    E(cuMemsetD8Async, 3020, cuMemsetD8Async) \
    PTSZ(cuMemsetD8Async, 7000, cuMemsetD8Async_ptsz) \
    E(cuMemsetD16Async, 3020, cuMemsetD16Async) \
    PTSZ(cuMemsetD16Async, 7000, cuMemsetD16Async_ptsz) \
    E(cuMemsetD32Async, 3020, cuMemsetD32Async) \
    PTSZ(cuMemsetD32Async, 7000, cuMemsetD32Async_ptsz) \
    E(cuStreamCreate, 2000, cuStreamCreate) \
    E(cuStreamCreateWithPriority, 5050, cuStreamCreateWithPriority) \
    E(cuStreamGetPriority, 5050, cuStreamGetPriority) \
    PTSZ(cuStreamGetPriority, 7000, cuStreamGetPriority_ptsz) \
    E(cuStreamGetFlags, 5050, cuStreamGetFlags) \
    PTSZ(cuStreamGetFlags, 7000, cuStreamGetFlags_ptsz) \
    E(cuStreamGetCtx, 9020, cuStreamGetCtx) \
    PTSZ(cuStreamGetCtx, 9020, cuStreamGetCtx_ptsz) \
    E(cuStreamGetCtx, 12050, cuStreamGetCtx_v2) \
    PTSZ(cuStreamGetCtx, 12050, cuStreamGetCtx_v2_ptsz) \
    E(cuStreamWaitEvent, 3020, cuStreamWaitEvent) \
    PTSZ(cuStreamWaitEvent, 7000, cuStreamWaitEvent_ptsz) \
    E(cuStreamQuery, 2000, cuStreamQuery) \
    PTSZ(cuStreamQuery, 7000, cuStreamQuery_ptsz) \
    E(cuStreamSynchronize, 2000, cuStreamSynchronize) \
    PTSZ(cuStreamSynchronize, 7000, cuStreamSynchronize_ptsz) \
    E(cuStreamDestroy, 2000, cuStreamDestroy) \
    E(cuStreamDestroy, 4000, cuStreamDestroy_v2) \
    E(cuEventCreate, 2000, cuEventCreate) \
    E(cuEventRecord, 2000, cuEventRecord) \
    PTSZ(cuEventRecord, 7000, cuEventRecord_ptsz) \
    E(cuEventRecordWithFlags, 11010, cuEventRecordWithFlags) \
    PTSZ(cuEventRecordWithFlags, 11010, cuEventRecordWithFlags_ptsz) \
    E(cuEventQuery, 2000, cuEventQuery) \
    E(cuEventSynchronize, 2000, cuEventSynchronize) \
    E(cuEventElapsedTime, 2000, cuEventElapsedTime) \
    E(cuEventElapsedTime, 12080, cuEventElapsedTime_v2) \
    E(cuEventDestroy, 2000, cuEventDestroy) \
    E(cuEventDestroy, 4000, cuEventDestroy_v2) \
    E(cuLaunchKernel, 4000, cuLaunchKernel) \
    PTSZ(cuLaunchKernel, 7000, cuLaunchKernel_ptsz) \
    E(cuLaunchKernelEx, 11060, cuLaunchKernelEx) \
    PTSZ(cuLaunchKernelEx, 11060, cuLaunchKernelEx_ptsz) \
    E(cuLaunchCooperativeKernel, 9000, cuLaunchCooperativeKernel) \
    PTSZ(cuLaunchCooperativeKernel, 9000, cuLaunchCooperativeKernel_ptsz) \
    E(cuGraphCreate, 10000, cuGraphCreate) \
    E(cuGraphAddKernelNode, 10000, cuGraphAddKernelNode) \
    E(cuGraphAddKernelNode, 12000, cuGraphAddKernelNode_v2) \
    E(cuGraphAddEmptyNode, 10000, cuGraphAddEmptyNode) \
    E(cuGraphGetNodes, 10000, cuGraphGetNodes) \
    E(cuGraphInstantiate, 10000, cuGraphInstantiate) \
    E(cuGraphInstantiate, 11000, cuGraphInstantiate_v2) \
    E(cuGraphInstantiateWithFlags, 11040, cuGraphInstantiateWithFlags) \
    E(cuGraphInstantiateWithParams, 12000, cuGraphInstantiateWithParams) \
    PTSZ(cuGraphInstantiateWithParams, 12000, cuGraphInstantiateWithParams_ptsz) \
    E(cuGraphUpload, 11010, cuGraphUpload) \
    PTSZ(cuGraphUpload, 11010, cuGraphUpload_ptsz) \
    E(cuGraphLaunch, 10000, cuGraphLaunch) \
    PTSZ(cuGraphLaunch, 10000, cuGraphLaunch_ptsz) \
    E(cuGraphExecDestroy, 10000, cuGraphExecDestroy) \
    E(cuGraphDestroy, 10000, cuGraphDestroy) \
    E(cuStreamBeginCapture, 10000, cuStreamBeginCapture) \
    PTSZ(cuStreamBeginCapture, 10000, cuStreamBeginCapture_ptsz) \
    E(cuStreamBeginCapture, 10010, cuStreamBeginCapture_v2) \
    PTSZ(cuStreamBeginCapture, 10010, cuStreamBeginCapture_v2_ptsz) \
    E(cuStreamEndCapture, 10000, cuStreamEndCapture) \
    PTSZ(cuStreamEndCapture, 10000, cuStreamEndCapture_ptsz) \
    E(cuStreamIsCapturing, 10000, cuStreamIsCapturing) \
    PTSZ(cuStreamIsCapturing, 10000, cuStreamIsCapturing_ptsz) \
    /* end of table */

#define FG_CHECK(pfn, fn) \
    _Static_assert(__builtin_types_compatible_p(pfn, __typeof__(&fn)), #fn " does not match " #pfn);
#define CHECK_E(sym, ver, fn) FG_CHECK(PFN_##sym##_v##ver, fn)
#define CHECK_PTSZ(sym, ver, fn) FG_CHECK(PFN_##sym##_v##ver##_ptsz, fn)
#define CHECK_PTDS(sym, ver, fn) FG_CHECK(PFN_##sym##_v##ver##_ptds, fn)
FG_PROC_TABLE(CHECK_E, CHECK_PTSZ, CHECK_PTDS)

#define ENTRY_E(sym, ver, fn) {#sym, ver, 0, (void *)&fn},
#define ENTRY_PER_THREAD(sym, ver, fn) {#sym, ver, 1, (void *)&fn},
static const struct fg_proc g_procs[] = {FG_PROC_TABLE(ENTRY_E, ENTRY_PER_THREAD, ENTRY_PER_THREAD)};

/* Best entry for (symbol, version, per_thread); *name_known tells a too-old request from a miss. */
static const struct fg_proc *lookup(const char *symbol, int version, int per_thread, int *name_known)
{
    const struct fg_proc *best = NULL;
    *name_known = 0;
    for (int pass = per_thread ? 0 : 1; pass < 2 && !best; pass++) {
        int want_per_thread = pass == 0;
        for (size_t i = 0; i < sizeof g_procs / sizeof g_procs[0]; i++) {
            const struct fg_proc *p = &g_procs[i];
            if (p->per_thread != want_per_thread || strcmp(p->name, symbol) != 0)
                continue;
            *name_known = 1;
            if (p->version <= version && (!best || p->version > best->version))
                best = p;
        }
    }
    return best;
}

FG_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *symbolStatus)
{
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    if (flags & ~(cuuint64_t)(CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM))
        return CUDA_ERROR_INVALID_VALUE;
    int name_known;
    int per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const struct fg_proc *p = lookup(symbol, cudaVersion, per_thread, &name_known);
    *pfn = p ? p->fn : NULL;
    if (symbolStatus)
        *symbolStatus = p            ? CU_GET_PROC_ADDRESS_SUCCESS
                        : name_known ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                                     : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return p ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

FG_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}
