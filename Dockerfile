# One image for the API and the workers (Linux: mlx's CPU backend).
#   docker compose up --build
FROM python:3.12-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The system OpenBLAS: MLX's CPU matmuls run about 30x faster with it (worker/supervisor/openblas.py).
RUN apt-get update && apt-get install -y --no-install-recommends libopenblas0-pthread \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
# Metadata first, so that the dependency layer is rebuilt only when it changes.
COPY pyproject.toml README.md ./
COPY api ./api
COPY cli ./cli
COPY shared ./shared
COPY worker ./worker
RUN pip install .

# Models and adapters live on the /data volume (MTQ_HOME, MTQ_MODELS_DIR). Everything runs
# as an unprivileged user that owns /data (a new named volume takes this ownership).
RUN useradd --system --uid 10001 --user-group --home-dir /data --no-create-home mtq \
    && mkdir -p /data/models && chown -R mtq:mtq /data
USER mtq
WORKDIR /data
EXPOSE 8000
CMD ["mtq", "api", "--host", "0.0.0.0"]
