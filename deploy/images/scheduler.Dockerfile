# The chart's scheduler image (charts/tessera values.yaml scheduler.image) from the kube-scheduler that
# hack/k8s-binaries.sh builds: a static Go binary (CGO_ENABLED=0), so nothing else goes in. Built by
# hack/build-images.sh with the binary as the only file of the build context.
FROM scratch
ARG K8S_VERSION
LABEL org.opencontainers.image.title="kube-scheduler" org.opencontainers.image.version="${K8S_VERSION}"
COPY kube-scheduler /usr/local/bin/kube-scheduler
ENV PATH=/usr/local/bin
# kube-scheduler needs no root: it reads its config, talks to the API server and serves /healthz on
# 10259 with a self-signed certificate kept in memory. 65532 is the distroless "nonroot" user.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kube-scheduler"]
