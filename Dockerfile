# lora-router: one small image whose entrypoint is the command.
#   docker build -t lora-router .
#   docker run --rm --network host -e HF_TOKEN lora-router \
#     --replicas https://a--8000.hf.jobs,https://b--8000.hf.jobs --token-env HF_TOKEN
# It must share the trainer's network (the host's, or the pod's as a sidecar) and listen on
# loopback: TRL sends no Authorization header, so a router on 0.0.0.0 with --api-key-env
# answers TRL 401. See docs/architecture.md, "Docker".
FROM python:3.11-slim AS build
WORKDIR /src
COPY setup.cfg pyproject.toml README.md ./
COPY lora_router ./lora_router
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin router
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER router
EXPOSE 8000
ENTRYPOINT ["lora-router"]
CMD ["--help"]
