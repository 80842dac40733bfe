# One image for Tessera's node agent (tessera-device-plugin or tessera-dra, with libvgpu.so) and the scheduler
# extender (tessera-extender). Build: docker build -t tessera:0.1.0 .
# The hook is compiled against the CUDA and NVML headers that NVIDIA publishes on PyPI; the image
# carries no CUDA driver: on a GPU node the NVIDIA container toolkit provides it. Only the product is
# copied in (.dockerignore): the simulator, the sandbox and the fake GPU are tools under tools/ and
# never ship; tests/foundation/test_packaging.py checks that the wheel built here holds the product alone.
#
# BASE_IMAGE: any Debian-based image whose python3 (3.11 or later) and pip come first on PATH and whose
# pip may install into that Python. The default is the public image; hack/build-images.sh (make images)
# passes a local mmdebstrap of bookworm instead where no registry is reachable.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev make && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tessera tessera
COPY extender extender
COPY nodeagent nodeagent
COPY deviceplugin deviceplugin
COPY draplugin draplugin
COPY hook hook
COPY proto proto
RUN pip install --no-cache-dir "nvidia-cuda-runtime>=12.6,<14" "nvidia-nvml-dev>=12.6,<14" \
 && make -C hook PYTHON=python3 \
 && pip wheel --no-cache-dir --no-deps -w /wheels .

FROM ${BASE_IMAGE}
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin tessera
# The chart's init container copies the hook from here to the host path that containers mount.
COPY --from=build /src/hook/build/libvgpu.so /usr/local/tessera/libvgpu.so
# Non-root by default: the extender needs no privileges at all. The node agent (the entrypoint) runs as
# root only because its DaemonSet says so (runAsUser: 0, privileged); docs/install.md says why.
# Numeric, so that a pod's runAsNonRoot can verify it.
USER 10001:10001
ENTRYPOINT ["tessera-device-plugin"]
