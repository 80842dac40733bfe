/* The fake GPUs' description, read once per process from the file named by FAKEGPU_CONFIG.
 * Format (docs/fakegpu.md): one `gpu key=value ...` line per GPU, an optional `driver ...` line. */
#ifndef FAKEGPU_CONFIG_H
#define FAKEGPU_CONFIG_H

#include <limits.h>
#include <stdint.h>

#define FG_MAX_GPUS 16
#define FG_MAX_NVLINKS 18
#define FG_UUID_LEN 40 /* "GPU-" + 36 characters */

struct fg_gpu_spec {
    char name[96];
    char uuid[FG_UUID_LEN + 1];
    unsigned char uuid_bytes[16];
    uint64_t memory_bytes;
    int sm_count;
    int cc_major;
    int cc_minor;
    unsigned pci_domain;
    unsigned pci_bus;
    unsigned pci_device;
    unsigned pci_device_id; /* NVML's combined 16-bit device id and 16-bit vendor id */
    int numa_node;          /* -1: not reported */
    int nvlink_count;
    int nvlink_peer[FG_MAX_NVLINKS]; /* index of the peer GPU in the config */
    /* The scheduler model (docs/fakegpu.md, "Time model"): its line's values, else the driver line's. */
    int64_t timeslice_us; /* -1 until set */
    int64_t switch_us;    /* -1 until set */
};

struct fg_config {
    char path[PATH_MAX];
    char state_dir[PATH_MAX];
    char driver_version[32];
    int cuda_version;
    unsigned util_window_ms;
    int64_t timeslice_us; /* the driver line's, for GPUs whose line names none */
    int64_t switch_us;
    int gpu_count;
    struct fg_gpu_spec gpus[FG_MAX_GPUS];
    /* GPUs the (emulated) container runtime exposes, in order: NVIDIA_VISIBLE_DEVICES. */
    int present_count;
    int present[FG_MAX_GPUS];
};

/* The process-wide configuration, or NULL after printing why it could not be read (once). */
const struct fg_config *fg_config(void);

/* Index in cfg->gpus of the GPU named by `id` (decimal index into `among`, or UUID prefix with or
 * without "GPU-"); -1 if none matches or the prefix is ambiguous. */
int fg_config_find_gpu(const struct fg_config *cfg, const int *among, int among_count, const char *id);

/* Formats a PCI bus id: "%04x:%02x:%02x.0" for CUDA (domain_width 4) or 8 for NVML. */
void fg_format_pci(const struct fg_gpu_spec *gpu, int domain_width, int upper, char *out, unsigned size);

/* Parses "domain:bus:device.function" (domain optional); 0 on success. */
int fg_parse_pci(const char *text, unsigned *domain, unsigned *bus, unsigned *device);

#endif
