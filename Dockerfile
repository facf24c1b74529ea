FROM python:3.11-slim
WORKDIR /srv/kvprefetch
COPY pyproject.toml README.md ./
COPY client ./client
COPY app ./app
COPY sim ./sim
COPY bench ./bench
COPY training ./training
COPY models ./models
COPY data ./data
# Editable: the scenarios (data/) and the bundled model (models/) are read from the source tree.
RUN pip install --no-cache-dir -e ./client -e '.[fast]'
# 0.0.0.0 needs tokens (KVP_TOKENS_FILE or KVP_*_TOKEN): without any the service refuses to start.
ENV KVP_HOST=0.0.0.0 KVP_DATA_DIR=/var/lib/kvprefetch
VOLUME /var/lib/kvprefetch
EXPOSE 8000
CMD ["kvprefetch", "serve"]
