# One image for Tessera's node agent (tessera-device-plugin, with libvgpu.so) and the scheduler
# extender (tessera-extender). Build: docker build -t tessera:0.1.0 .
# The hook is compiled against the CUDA and NVML headers that NVIDIA publishes on PyPI; the image
# carries no CUDA driver: on a GPU node the NVIDIA container toolkit provides it. Only the product is
# copied in (.dockerignore): the simulator, the sandbox and the fake GPU are tools under tools/ and
# never ship; tests/foundation/test_packaging.py checks that the wheel built here holds the product alone.

FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc make && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tessera tessera
COPY extender extender
COPY deviceplugin deviceplugin
COPY hook hook
COPY proto proto
RUN pip install --no-cache-dir "nvidia-cuda-runtime>=12.6,<14" "nvidia-nvml-dev>=12.6,<14" \
 && make -C hook PYTHON=python3 \
 && pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
# The device plugin copies the hook from here to the host path that containers mount.
COPY --from=build /src/hook/build/libvgpu.so /usr/local/tessera/libvgpu.so
USER 0
ENTRYPOINT ["tessera-device-plugin"]
