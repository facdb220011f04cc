FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN pip install mlflow==3.17.2 psycopg2-binary==2.9.13

# Non-root; /mlartifacts is created here so a fresh named volume inherits its owner.
RUN useradd --system --create-home --uid 10001 mlflow \
    && mkdir -p /mlartifacts \
    && chown mlflow:mlflow /mlartifacts
USER mlflow
WORKDIR /home/mlflow

EXPOSE 5000
CMD ["mlflow", "server", "--host", "0.0.0.0", "--port", "5000"]
