"""`tessera sandbox`: a local cluster with a real kubelet and containerd running pods on fake GPUs.

Runs from a checkout: it uses the hook and fake driver built there (`make native`), the scheduler
profile in deploy/, and compiles the probe from tools/sandbox/vgpu_probe.c. See docs/sandbox.md.
"""
