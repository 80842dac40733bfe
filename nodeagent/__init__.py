"""What both node agents (``tessera-device-plugin`` and ``tessera-dra``) are built from: the process
around them, the state dir and its records, atomic writes, NVML discovery, the API server's client,
the hook's mounts and the flags they both take."""
