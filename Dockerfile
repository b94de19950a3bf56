# One image for both services of compose.yaml (rollout server and learner): python 3.11 + rollmatch[gpu].
# The NVIDIA driver comes from the host through the NVIDIA Container Toolkit; CUDA libraries come with the
# torch/vLLM wheels, so a slim Python base is enough.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# curl: the compose healthcheck and the launchers' /health polling; procps: `ps` in the launchers (they only
# ever signal the process group they started); gcc + libc6-dev: Triton compiles small helper modules at
# run time and fails without a C compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl procps gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . /app
RUN pip install -e ".[gpu]"

# Models, data and run outputs are mounted (see compose.yaml); nothing is downloaded at run time.
CMD ["python", "-m", "learner", "--help"]
