/* libFuzzer target: the limits-file parser (src/limits.c), fed any bytes as a file's content.
 * Built with AddressSanitizer and UndefinedBehaviorSanitizer (hook/Makefile: make fuzz): any
 * out-of-bounds access, overflow or leak aborts the run. Also checks what a parse promises: a
 * refusal says why, and an accepted file has a version, a device and an absolute region. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vgpu.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static struct vgpu_limits limits;
    memset(&limits, 0, sizeof limits);
    int rc = vgpu_limits_parse(&limits, (const char *)data, size, "fuzz");
    if (rc != 0 && (!limits.refuse_memory || !limits.why[0])) abort();
    if (rc == 0 && (limits.refuse_memory || limits.file_devices < 1 || limits.file_devices > VGPU_MAX_DEVICES ||
                    limits.region[0] != '/'))
        abort();
    for (int i = 0; rc == 0 && i < limits.file_devices; i++)
        if (!limits.by_uuid[i].quota.memory_quota || limits.by_uuid[i].quota.cores < 0 ||
            limits.by_uuid[i].quota.cores > VGPU_MAX_CORES || !memchr(limits.by_uuid[i].uuid, 0, VGPU_UUID_LEN))
            abort();
    return 0;
}
