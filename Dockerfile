# One image for every PDD service; `python -m services.<name>` picks which one runs — the same
# entry points `pdd up` starts (docker-compose.yml and deploy/k8s set the command per service).
# Config is environment-driven: every flag has a PDD_* default (python -m services.<name> --help).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PDD_HOST=0.0.0.0 \
    PDD_LOG_FORMAT=json \
    TORCH_EXTENSIONS_DIR=/opt/pdd/torch_extensions

# g++ and ninja compile the engine's paged decode kernel (pdd/engine/paged_decode.py; built below, at
# image build time, so no service compiles at start). Without them the engine falls back to gather + SDPA.
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ ninja-build \
 && rm -rf /var/lib/apt/lists/*

# NOTE: torch first, pinned, CPU build: an unpinned torch pulls a multi-GB CUDA build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /app
# The dependencies alone first (read from pyproject.toml), so that a code change reuses this layer.
COPY pyproject.toml ./
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
print('\n'.join(d for d in deps if not d.startswith('torch')))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt

COPY README.md ./
COPY protos ./protos
COPY services ./services
COPY pdd ./pdd
RUN pip install --no-deps . \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin pdd \
 && python -c "from pdd.engine import paged_decode; paged_decode.load()" \
 && chown -R 10001 /opt/pdd/torch_extensions

USER 10001
# gateway gRPC, kvstore, prefill, relay, main_decode; gateway HTTP; plaintext health; metrics.
EXPOSE 50050 50051 50052 50053 50054 8000 50061 9090
CMD ["python", "-m", "services.gateway"]
