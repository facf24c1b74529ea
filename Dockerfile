# The service installed from its wheels: they carry the bundled model and the shipped scenarios
# (setup.py copies models/default and data/scenarios into the package), so the image needs no
# source tree.
FROM python:3.11-slim AS wheels
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY client ./client
COPY app ./app
COPY kvprefetch_cli ./kvprefetch_cli
COPY sim ./sim
COPY bench ./bench
COPY training ./training
COPY models ./models
COPY data ./data
RUN pip wheel --no-cache-dir --no-deps . ./client -w /wheels

FROM python:3.11-slim
COPY --from=wheels /wheels /tmp/wheels
# The fast extra: the arrival model compiled with lleaves. The service alone otherwise; scheduled
# retraining (KVP_RETRAIN_EVERY_SECONDS) needs the training extra: --build-arg EXTRAS=fast,training.
ARG EXTRAS=fast
RUN pip install --no-cache-dir /tmp/wheels/kvprefetch_client-*.whl \
        "$(ls /tmp/wheels/kvprefetch-[0-9]*.whl)[${EXTRAS}]" \
    && rm -rf /tmp/wheels
# The bundled model's machine code, so the service scores compiled from its first second (a first
# compile takes a minute or more). The cache is keyed by the CPU too: on another model of CPU the
# service compiles again in the background, the Booster serving meanwhile.
RUN if pip show lleaves >/dev/null 2>&1; then kvprefetch compile-model; fi
WORKDIR /srv/kvprefetch
# 0.0.0.0 needs tokens (KVP_TOKENS_FILE or KVP_*_TOKEN): without any the service refuses to start.
ENV KVP_HOST=0.0.0.0 KVP_DATA_DIR=/var/lib/kvprefetch
VOLUME /var/lib/kvprefetch
EXPOSE 8000
CMD ["kvprefetch", "serve"]
