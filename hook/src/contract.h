/* What the hook and its Python side must agree on, in one place: hook/limits.py writes the limits
 * file that limits.c parses, hook/region.py reads struct vgpu_device_usage (snapshot.h), and users
 * set the environment variables (docs/hook.md). Python keeps its own copies, since writing a limits
 * file must not need libvgpu.so; tests/hook/test_constants.py compiles this header and fails when
 * the two differ. The compiled-in paths of the limits file and the region come from hook/Makefile
 * (VGPU_LIMITS_FILE, VGPU_REGION_FILE), checked against Python by the same test. Only plain C here:
 * the test compiles it without CUDA's headers. */
#ifndef VGPU_CONTRACT_H
#define VGPU_CONTRACT_H

#define VGPU_LIMITS_VERSION 4 /* hook.limits.LIMITS_FORMAT_VERSION: the newest `version` line */
#define VGPU_LIMITS_OLDEST_VERSION 1 /* still read: version 1 has no `qos` or `coordination` lines */
#define VGPU_LIMITS_OVERSUBSCRIBED_VERSION 3 /* the first with `oversubscribed` lines (hook.limits) */
#define VGPU_LIMITS_MPS_VERSION 4 /* the first with an `mps` line (hook.limits.MPS_VERSION) */
#define VGPU_MAX_SHORTFALL_WAIT_MS 600000 /* hook.limits.MAX_SHORTFALL_WAIT_MS: an `oversubscribed` wait */
#define VGPU_MAX_DEVICES 16   /* hook.limits.MAX_DEVICES: GPUs per container (also the region's) */
#define VGPU_UUID_LEN 80      /* hook.limits.MAX_UUID_LENGTH + 1, for the NUL */
#define VGPU_MAX_CORES 100    /* tessera.contract.MAX_CORES: cores are percent of a GPU's time */

/* Environment: the limits file outside Kubernetes (tests), and the standalone quotas; the memory
 * and cores variables also exist per CUDA ordinal, with the suffix _<i>. */
#define VGPU_ENV_LIMITS_FILE "TESSERA_LIMITS_FILE"
#define VGPU_ENV_MEMORY_LIMIT "TESSERA_MEMORY_LIMIT"
#define VGPU_ENV_CORES "TESSERA_CORES"
#define VGPU_ENV_ELASTIC "TESSERA_ELASTIC"
#define VGPU_ENV_REGION "TESSERA_REGION"
#define VGPU_ENV_QOS "TESSERA_QOS"
#define VGPU_ENV_COORDINATION "TESSERA_COORDINATION"
/* Standalone MPS client settings, as the limits file's `mps` line's arguments:
 * "<pipe directory> threads <1-100> priority <0|1>" (docs/hook.md, "MPS mode"). */
#define VGPU_ENV_MPS "TESSERA_MPS"

/* QoS classes (tessera.contract.QosClass), as the limits file's `qos` line and TESSERA_QOS spell
 * them; each is also the name of its directory in a GPU's coordination area (docs/hook.md). */
#define VGPU_QOS_LATENCY_CRITICAL "latency-critical"
#define VGPU_QOS_STANDARD "standard"
#define VGPU_QOS_BEST_EFFORT "best-effort"
/* A container's own slot of a GPU's coordination area is mounted at <coordination>/<uuid> plus this
 * suffix (tessera.contract.COORDINATION_SLOT_SUFFIX); the device plugin creates it with this many
 * zero bytes (tessera.contract.COORDINATION_SLOT_BYTES). */
#define VGPU_COORDINATION_SLOT_SUFFIX ".slot"
#define VGPU_COORDINATION_SLOT_BYTES 64

#endif
