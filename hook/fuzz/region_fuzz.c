/* libFuzzer target: the region reader (src/snapshot.c), fed any bytes as the start of a region file
 * (the rest zero, as a file the size of the layout would be; a container can write all of it).
 * Built with AddressSanitizer and UndefinedBehaviorSanitizer (hook/Makefile: make fuzz). Every slot
 * counts as alive (no file descriptor to ask), so every forged count and usage is summed. Also
 * checks what a snapshot promises: a count within the capacity, strings terminated, usage never
 * above what the locked total says. */
#include <stdlib.h>
#include <string.h>

#include "snapshot.h"
#include "vgpu.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    struct vgpu_region *r = calloc(1, sizeof *r);
    if (!r) return 0;
    memcpy(r, data, size < sizeof *r ? size : sizeof *r);
    struct vgpu_device_usage out[VGPU_MAX_DEVICES];
    int live = -1;
    int capacity = size ? data[0] % (VGPU_MAX_DEVICES + 1) : VGPU_MAX_DEVICES; /* smaller buffers too */
    int n = vgpu_region_snapshot(r, -1, out, capacity, &live);
    if (n > capacity || live < 0 || live > VGPU_MAX_PROCS) abort();
    for (int d = 0; d < n; d++)
        if (!memchr(out[d].uuid, 0, sizeof out[d].uuid) || out[d].memory_used > r->dev[d].used ||
            out[d].processes > VGPU_MAX_PROCS)
            abort();
    free(r);
    return 0;
}
