# A CPU serving image: the runtime and the server (the serve extra, nothing of the build side), the
# CPU build of torch, one artifact, and `precompile serve` as the entrypoint.
#
#   precompile build profile.yaml -o artifacts/my-model          # in CI, on a CPU like the fleet's
#   docker build -t my-model:7 --build-arg ARTIFACT=artifacts/my-model .
#   docker run --rm -p 8000:8000 --cpus 2 my-model:7
#
# With no artifact baked in, give a pack or a pointer in a store as the argument instead (the s3 extra
# is then needed: --build-arg EXTRAS=serve,s3), and --watch to follow deploys:
#   docker run --rm -p 8000:8000 my-model:7 s3://models/my-model/current --watch
# The artifact must be built with this image's torch (2.13) for CPUs that the serving hosts have.

ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY loader loader
COPY precompile precompile
RUN pip wheel --no-deps --no-cache-dir -w /wheels .

FROM python:${PYTHON}-slim
# The CPU wheel of torch (the default index's torch is the CUDA build, several GB larger).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=serve
ARG ARTIFACT=artifacts/text-classifier
# tcmalloc: `precompile serve` preloads it (--malloc auto), which keeps each call's buffers for the next
# instead of glibc's bookkeeping and page faults (loader/malloc.py: MobileNetV2 1.43 -> 0.97 ms a call at 1x96^2).
RUN apt-get update && apt-get install -y --no-install-recommends libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=wheel /wheels /wheels
COPY constraints.txt /tmp/constraints.txt
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" -c /tmp/constraints.txt \
        "torch==2.13.0" "$(ls /wheels/precompile-*.whl)[${EXTRAS}]" \
    && rm -rf /wheels /tmp/constraints.txt
# A user of its own; the cache (packs pulled from a store) and the version records are its folders,
# 0755 as the loader requires of them. The artifact stays root's, readable by all (precompile build
# writes artifacts 0755/0644).
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin precompile \
    && install -d -o precompile -g precompile -m 0755 /var/cache/precompile /var/lib/precompile
COPY ${ARTIFACT} /srv/artifact
ENV PRECOMPILE_CACHE=/var/cache/precompile \
    PRECOMPILE_STATE=/var/lib/precompile \
    OMP_WAIT_POLICY=ACTIVE \
    GOMP_SPINCOUNT=10000 \
    PYTHONUNBUFFERED=1
# OMP_NUM_THREADS is left unset on purpose: the server sizes its threads to the CPUs the container
# gets (its cgroup CPU quota: `docker run --cpus`, a Kubernetes CPU limit) and its affinity mask.
USER 10001
EXPOSE 8000
# SIGTERM (docker stop, a pod's termination) drains: the server stops accepting connections, finishes
# the requests in flight, writes --record, and exits with status 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["precompile", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["/srv/artifact"]
