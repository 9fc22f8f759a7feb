# The ledger-cdc sidecar: `ledger-cdc consume` (and every other command) in a slim image.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ledger_cdc ./ledger_cdc
COPY sql ./sql
RUN pip wheel --no-cache-dir --wheel-dir /wheels '.[nats]'

FROM python:3.11-slim
RUN useradd --system --uid 10001 ledger
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER ledger
EXPOSE 9187
# healthy = streaming and caught up (/healthz answers 503 with its reasons otherwise)
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9187/healthz', timeout=2)"
ENTRYPOINT ["ledger-cdc"]
CMD ["consume", "--metrics-port", "9187", "--metrics-host", "0.0.0.0", "--log-format", "json"]
