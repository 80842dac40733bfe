"""Python side of the CUDA hook ``libvgpu.so``.

- :mod:`hook.limits`: the typed writer of the limits file the hook reads inside a container.
- :mod:`hook.region`: reads a container's shared accounting region (through ``libvgpu.so``) into
  typed usage, for metrics and tests.
"""
