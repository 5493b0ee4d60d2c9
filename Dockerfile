# The image of the KubeRay manifest (cluster-configs/kuberay-spot-gpu.yaml): Ray 2.60 with elastic installed from
# this checkout, so the pods run the code of the machine that builds the image. From the repository root:
#
#   TAG=$(git rev-parse --short HEAD)
#   docker build -t REGISTRY/elastic-train:$TAG-gpu .                      # GKE: gs:// checkpoints ([gcp])
#   docker build --build-arg EXTRAS= -t REGISTRY/elastic-train:$TAG-gpu .   # EKS: s3:// needs no extra
#   docker push REGISTRY/elastic-train:$TAG-gpu
#
# then set that image in the manifest. Once elastic-train is published on PyPI, a release can replace the COPY
# lines: RUN pip install --no-cache-dir "elastic-train[gcp]==X.Y.Z" (X.Y.Z: `elastic --version` on your laptop).
# The same Python minor version as the head's image and your laptop's Ray client is not required for the job API,
# but Ray must be 2.60 everywhere: elastic pins it.
FROM rayproject/ray:2.60.0-py311-gpu

# Storage extras: gcp (gcsfs, gs://), azure (adlfs, az://), or empty for S3 only.
ARG EXTRAS=gcp

# Only what the package needs to build; jobs bring their own code (their working_dir).
COPY --chown=ray:users pyproject.toml README.md /tmp/elastic-src/
COPY --chown=ray:users elastic /tmp/elastic-src/elastic

# pip >= 25.0: older resolvers give up on s3fs's botocore pin (ResolutionImpossible).
RUN pip install --no-cache-dir --upgrade "pip>=25.0" \
    && pip install --no-cache-dir "/tmp/elastic-src${EXTRAS:+[$EXTRAS]}" \
    && rm -rf /tmp/elastic-src \
    && elastic --version
