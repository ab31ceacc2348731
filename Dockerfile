# One image for every lockstep service; compose.yaml picks the service with the command
# (`lockstep api-server | scheduler | engine-worker | init`). Settings come from LOCKSTEP_*
# environment variables (docs/configuration.md).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_NUM_THREADS=1

WORKDIR /app
# Dependencies first, so a code change does not reinstall them. CPU torch wheels by default;
# for NCCL on GPUs build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
RUN mkdir -p services shared && touch services/__init__.py shared/__init__.py \
 && pip install --extra-index-url "${TORCH_INDEX}" . \
 && pip uninstall -y lockstep
COPY services ./services
COPY shared ./shared
RUN pip install --no-deps . && useradd --create-home --uid 10001 lockstep
USER lockstep

# Engines announce where the other ranks reach them (rendezvous): the container's address.
ENTRYPOINT ["/bin/sh", "-c", "export LOCKSTEP_GROUP_HOST=\"${LOCKSTEP_GROUP_HOST:-$(hostname -i | cut -d' ' -f1)}\"; exec lockstep \"$@\"", "lockstep"]
CMD ["--help"]
