# karpenter-teardown for CI runners outside the cluster: the lean, statically linked (musl) build
# on an empty base, with a CA bundle for AWS's endpoints, run as a non-root user. The API
# server's certificate authority comes from the kubeconfig, as everywhere else.
#
# Built for amd64 and arm64 without a Docker engine by `release/image` (buildah), which puts the
# binary for each architecture at bin/<arch>/ and the CA bundle beside this file; docs/release.md
# has the procedure. Run it with the kubeconfig and the working directory mounted:
#   docker run --rm -v "$PWD:/work" -w /work -e KUBECONFIG=/work/kubeconfig \
#     -e AWS_REGION -e AWS_ACCESS_KEY_ID -e AWS_SECRET_ACCESS_KEY -e AWS_SESSION_TOKEN \
#     IMAGE run --cluster NAME --region REGION --yes
FROM scratch
ARG TARGETARCH
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY bin/${TARGETARCH}/karpenter-teardown /usr/local/bin/karpenter-teardown
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
# no home directory on an empty base: the kubeconfig is named by KUBECONFIG or --kubeconfig
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/karpenter-teardown"]
