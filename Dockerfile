# The collector image: FastAPI + SQLAlchemy (plotly.js is vendored), and no torch (the collector never imports it).
FROM python:3.11-slim

WORKDIR /src
COPY pyproject.toml README.md __init__.py ./
COPY agent ./agent
COPY ddp ./ddp
COPY server ./server
COPY dashboard ./dashboard
COPY cli ./cli
# The base dependency is torch (the training side); the collector needs only the `server` extra, so
# install the package without dependencies and the extra's list read from pyproject.toml (one source).
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml','rb'))['project']['optional-dependencies']['server']))" > /tmp/server-requirements.txt \
 && pip install --no-cache-dir -r /tmp/server-requirements.txt \
 && pip install --no-cache-dir --no-deps . \
 && useradd --system --uid 10001 --home /data ddpscope \
 && mkdir -p /data && chown ddpscope /data

USER ddpscope
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8321
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8321/healthz', timeout=2)"]
ENTRYPOINT ["ddpscope", "serve", "--host", "0.0.0.0", "--port", "8321"]
# Overridden by docker-compose with --token (a non-loopback collector refuses to start without one).
CMD ["--db", "sqlite:////data/ddpscope.db", "--no-auth"]
