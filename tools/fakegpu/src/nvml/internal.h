/* Shared declarations of the fake libnvidia-ml. NVML sees every GPU the (emulated) container
 * runtime exposes, in config order, and ignores CUDA_VISIBLE_DEVICES, like the real library. */
#ifndef FAKEGPU_NVML_INTERNAL_H
#define FAKEGPU_NVML_INTERNAL_H

#include <nvml.h>

#include "../common/config.h"
#include "../common/shared.h"

#define FG_API __attribute__((visibility("default")))

struct nvmlDevice_st {
    int gpu;   /* index in the config */
    int index; /* NVML index: position among the GPUs the runtime exposes */
    struct fg_shared *shared;
};

/* nvml_init.c */
extern const struct fg_config *fg_nvml_cfg;
nvmlReturn_t fg_nvml_check_init(void);
/* The device behind a handle: NVML_SUCCESS, or why not (uninitialised, bad handle, GPU lost). */
nvmlReturn_t fg_nvml_device(nvmlDevice_t device);
/* Handle of the NVML index. */
nvmlDevice_t fg_nvml_handle(unsigned index);
unsigned fg_nvml_count(void);

/* nvml_pids.c: the pid the caller sees `pid` by (0: a process the caller cannot see). */
unsigned fg_visible_pid(struct fg_pid pid);

/* Paths of the test controls in the state dir (docs/fakegpu.md): "lost" and "xid". */
void fg_nvml_control_path(const struct fg_gpu_spec *gpu, const char *kind, char *out, size_t size);

#endif
