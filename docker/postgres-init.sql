-- Runs once, on first start with an empty data volume (postgres entrypoint
-- convention). MLflow keeps its tracking store in its own database so its
-- Alembic migrations never touch the streamtune schema.
CREATE DATABASE mlflow OWNER streamtune;
