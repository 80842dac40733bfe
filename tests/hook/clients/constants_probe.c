/* Prints what the hook and its Python side must agree on (hook/src/contract.h, snapshot.h), one
 * `name value` per line, for tests/hook/test_constants.py. Compiled without CUDA's headers. */
#include <stddef.h>
#include <stdio.h>

#include "contract.h"
#include "snapshot.h"

#define FIELD(name)                                                                          \
    printf("field.%s %zu %zu\n", #name, offsetof(struct vgpu_device_usage, name),           \
           sizeof(((struct vgpu_device_usage *)0)->name))

int main(void) {
    printf("VGPU_LIMITS_VERSION %d\n", VGPU_LIMITS_VERSION);
    printf("VGPU_MAX_DEVICES %d\n", VGPU_MAX_DEVICES);
    printf("VGPU_UUID_LEN %d\n", VGPU_UUID_LEN);
    printf("VGPU_MAX_CORES %d\n", VGPU_MAX_CORES);
    printf("VGPU_ENV_LIMITS_FILE %s\n", VGPU_ENV_LIMITS_FILE);
    printf("VGPU_ENV_MEMORY_LIMIT %s\n", VGPU_ENV_MEMORY_LIMIT);
    printf("VGPU_ENV_CORES %s\n", VGPU_ENV_CORES);
    printf("VGPU_ENV_ELASTIC %s\n", VGPU_ENV_ELASTIC);
    printf("VGPU_ENV_REGION %s\n", VGPU_ENV_REGION);
    printf("VGPU_ENV_QOS %s\n", VGPU_ENV_QOS);
    printf("VGPU_ENV_COORDINATION %s\n", VGPU_ENV_COORDINATION);
    printf("VGPU_ENV_MPS %s\n", VGPU_ENV_MPS);
    printf("VGPU_LIMITS_OLDEST_VERSION %d\n", VGPU_LIMITS_OLDEST_VERSION);
    printf("VGPU_LIMITS_OVERSUBSCRIBED_VERSION %d\n", VGPU_LIMITS_OVERSUBSCRIBED_VERSION);
    printf("VGPU_LIMITS_MPS_VERSION %d\n", VGPU_LIMITS_MPS_VERSION);
    printf("VGPU_MAX_SHORTFALL_WAIT_MS %d\n", VGPU_MAX_SHORTFALL_WAIT_MS);
    printf("VGPU_QOS_LATENCY_CRITICAL %s\n", VGPU_QOS_LATENCY_CRITICAL);
    printf("VGPU_QOS_STANDARD %s\n", VGPU_QOS_STANDARD);
    printf("VGPU_QOS_BEST_EFFORT %s\n", VGPU_QOS_BEST_EFFORT);
    printf("VGPU_COORDINATION_SLOT_SUFFIX %s\n", VGPU_COORDINATION_SLOT_SUFFIX);
    printf("VGPU_COORDINATION_SLOT_BYTES %d\n", VGPU_COORDINATION_SLOT_BYTES);
    printf("sizeof.vgpu_device_usage %zu\n", sizeof(struct vgpu_device_usage));
    FIELD(uuid);
    FIELD(memory_used);
    FIELD(memory_quota);
    FIELD(busy_ns);
    FIELD(throttled_ns);
    FIELD(launches);
    FIELD(memory_peak);
    FIELD(refused);
    FIELD(memory_waiting);
    FIELD(cores);
    FIELD(elastic);
    FIELD(processes);
    FIELD(reserved);
    return 0;
}
