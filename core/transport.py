"""Encrypted transport: the one place where TLS and SASL settings for every client live.

Every Kafka, PostgreSQL, MongoDB and MLflow client streamtune opens takes its transport
settings from here, read from the environment of the process that opens it (a job's
settings are read where the job is built and travel inside the job graph, never on a
command line). Unset, each client keeps its plaintext default, which is what the local
stack serves.

| variable                                | client        | meaning                                         |
|-----------------------------------------|---------------|-------------------------------------------------|
| STREAMTUNE_KAFKA_SECURITY_PROTOCOL      | Kafka (all)   | PLAINTEXT (default), SSL, SASL_PLAINTEXT,        |
|                                         |               | SASL_SSL                                        |
| STREAMTUNE_KAFKA_SSL_CAFILE             | Kafka (all)   | PEM CA bundle that signed the brokers' certs    |
| STREAMTUNE_KAFKA_SSL_CERTFILE           | Kafka (all)   | client certificate (mutual TLS), PEM            |
| STREAMTUNE_KAFKA_SSL_KEYFILE            | Kafka (all)   | its private key, PEM; for Flink (Java) clients  |
|                                         |               | this file must hold the key and the chain       |
| STREAMTUNE_KAFKA_SSL_CHECK_HOSTNAME     | Kafka (all)   | true (default) / false                          |
| STREAMTUNE_KAFKA_SASL_MECHANISM         | Kafka (all)   | PLAIN (default with SASL), SCRAM-SHA-256,       |
|                                         |               | SCRAM-SHA-512                                   |
| STREAMTUNE_KAFKA_SASL_USERNAME          | Kafka (all)   | SASL user                                       |
| STREAMTUNE_KAFKA_SASL_PASSWORD_FILE     | Kafka (all)   | file holding the SASL password (first line)     |
| STREAMTUNE_KAFKA_SASL_PASSWORD_ENV      | Kafka (all)   | or: NAME of the env var holding it              |
| STREAMTUNE_PG_SSLMODE                   | psycopg       | disable, allow, prefer, require, verify-ca,     |
|                                         |               | verify-full (unset: libpq's default, `prefer`)  |
| STREAMTUNE_PG_SSLROOTCERT               | psycopg       | CA file for verify-ca / verify-full             |
| STREAMTUNE_MONGO_TLS                    | pymongo       | true / false (unset: the URI decides)           |
| STREAMTUNE_MONGO_TLS_CAFILE             | pymongo       | CA file                                         |
| STREAMTUNE_MLFLOW_CA_BUNDLE             | MLflow        | CA bundle for an https:// tracking server       |

The SASL password is never a value of its own variable or an argument: it is read from a
file (e.g. a mounted Kubernetes Secret) or from an env var the deployment names, each time
settings are rendered (a rotated file is picked up by the next client). The Java clients
inside Flink need it inside `sasl.jaas.config`; that string is a Kafka client property of the
job graph (Kafka logs it as `[hidden]`) and never appears on a command line.

The local stand-ins cannot do TLS: the Kafka broker (Tansu) and the MongoDB stand-in
(secantusdb) accept plaintext only, so for them these settings are checked as rendered client
configuration (tests/test_security_tls.py); PostgreSQL and MLflow (behind an HTTPS proxy) are
tested over real TLS.

>>> s = TransportSettings.from_env({})
>>> kafka_python_kwargs(s), confluent_config(s), flink_kafka_properties(s), psycopg_kwargs(s), pymongo_kwargs(s)
({}, {}, {}, {}, {})
>>> env = {"STREAMTUNE_KAFKA_SECURITY_PROTOCOL": "sasl_ssl", "STREAMTUNE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
...        "STREAMTUNE_KAFKA_SASL_USERNAME": "trainer", "STREAMTUNE_KAFKA_SASL_PASSWORD_ENV": "KAFKA_PW",
...        "KAFKA_PW": "s3cret", "STREAMTUNE_KAFKA_SSL_CAFILE": "/etc/ca.pem"}
>>> s = TransportSettings.from_env(env)
>>> s.kafka_security_protocol, s.kafka_sasl_mechanism
('SASL_SSL', 'SCRAM-SHA-512')
>>> "s3cret" in repr(s)
False
>>> k = kafka_python_kwargs(s)
>>> k["security_protocol"], k["sasl_mechanism"], k["sasl_plain_username"], k["ssl_cafile"]
('SASL_SSL', 'SCRAM-SHA-512', 'trainer', '/etc/ca.pem')
>>> flink_kafka_properties(s)["sasl.jaas.config"]
'org.apache.kafka.common.security.scram.ScramLoginModule required username="trainer" password="s3cret";'
>>> psycopg_kwargs(TransportSettings.from_env({"STREAMTUNE_PG_SSLMODE": "verify-full",
...                                            "STREAMTUNE_PG_SSLROOTCERT": "/etc/ca.pem"}))
{'sslmode': 'verify-full', 'sslrootcert': '/etc/ca.pem'}
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from core.errors import ConfigError

KAFKA_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
PG_SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
PREFIX = "STREAMTUNE_"


def _flag(value: Optional[str], name: str) -> Optional[bool]:
    if value is None or value == "":
        return None
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={value!r}: expected true or false")


@dataclass(frozen=True)
class TransportSettings:
    """TLS / SASL settings of every client; `from_env` reads them (see the module's table)."""

    kafka_security_protocol: str = "PLAINTEXT"
    kafka_ssl_cafile: Optional[str] = None
    kafka_ssl_certfile: Optional[str] = None
    kafka_ssl_keyfile: Optional[str] = None
    kafka_ssl_check_hostname: bool = True
    kafka_sasl_mechanism: Optional[str] = None
    kafka_sasl_username: Optional[str] = None
    # Where the password is, not the password: a file path or an env var name.
    kafka_sasl_password_file: Optional[str] = None
    kafka_sasl_password_env: Optional[str] = None
    pg_sslmode: Optional[str] = None
    pg_sslrootcert: Optional[str] = None
    mongo_tls: Optional[bool] = None
    mongo_tls_cafile: Optional[str] = None
    mlflow_ca_bundle: Optional[str] = None
    # The environment the password env var is looked up in (os.environ unless given).
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ, repr=False, compare=False)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "TransportSettings":
        env = os.environ if environ is None else environ

        def get(name: str) -> Optional[str]:
            value = env.get(PREFIX + name)
            return value if value else None

        protocol = (get("KAFKA_SECURITY_PROTOCOL") or "PLAINTEXT").upper()
        if protocol not in KAFKA_PROTOCOLS:
            raise ConfigError(f"{PREFIX}KAFKA_SECURITY_PROTOCOL={protocol}: expected one of {', '.join(KAFKA_PROTOCOLS)}")
        mechanism = get("KAFKA_SASL_MECHANISM")
        mechanism = mechanism.upper() if mechanism else ("PLAIN" if protocol.startswith("SASL") else None)
        if mechanism is not None and mechanism not in SASL_MECHANISMS:
            raise ConfigError(f"{PREFIX}KAFKA_SASL_MECHANISM={mechanism}: expected one of {', '.join(SASL_MECHANISMS)}")
        sslmode = get("PG_SSLMODE")
        if sslmode is not None and sslmode not in PG_SSLMODES:
            raise ConfigError(f"{PREFIX}PG_SSLMODE={sslmode}: expected one of {', '.join(PG_SSLMODES)}")
        settings = cls(
            kafka_security_protocol=protocol, kafka_ssl_cafile=get("KAFKA_SSL_CAFILE"),
            kafka_ssl_certfile=get("KAFKA_SSL_CERTFILE"), kafka_ssl_keyfile=get("KAFKA_SSL_KEYFILE"),
            kafka_ssl_check_hostname=_flag(get("KAFKA_SSL_CHECK_HOSTNAME"), PREFIX + "KAFKA_SSL_CHECK_HOSTNAME") is not False,
            kafka_sasl_mechanism=mechanism, kafka_sasl_username=get("KAFKA_SASL_USERNAME"),
            kafka_sasl_password_file=get("KAFKA_SASL_PASSWORD_FILE"),
            kafka_sasl_password_env=get("KAFKA_SASL_PASSWORD_ENV"),
            pg_sslmode=sslmode, pg_sslrootcert=get("PG_SSLROOTCERT"),
            mongo_tls=_flag(get("MONGO_TLS"), PREFIX + "MONGO_TLS"), mongo_tls_cafile=get("MONGO_TLS_CAFILE"),
            mlflow_ca_bundle=get("MLFLOW_CA_BUNDLE"), environ=env)
        if settings.kafka_sasl and not settings.kafka_sasl_username:
            raise ConfigError(f"{PREFIX}KAFKA_SECURITY_PROTOCOL={protocol} needs {PREFIX}KAFKA_SASL_USERNAME")
        if settings.kafka_sasl and not (settings.kafka_sasl_password_file or settings.kafka_sasl_password_env):
            raise ConfigError(f"{PREFIX}KAFKA_SECURITY_PROTOCOL={protocol} needs {PREFIX}KAFKA_SASL_PASSWORD_FILE "
                              f"or {PREFIX}KAFKA_SASL_PASSWORD_ENV (the password is never a setting of its own)")
        return settings

    @property
    def kafka_sasl(self) -> bool:
        return self.kafka_security_protocol.startswith("SASL")

    @property
    def kafka_ssl(self) -> bool:
        return self.kafka_security_protocol in ("SSL", "SASL_SSL")

    def kafka_sasl_password(self) -> str:
        """Read now (a rotated file is picked up by the next client); never stored on the settings."""
        if self.kafka_sasl_password_file:
            try:
                return Path(self.kafka_sasl_password_file).read_text().splitlines()[0]
            except (OSError, IndexError) as e:
                raise ConfigError(f"cannot read the Kafka SASL password file "
                                  f"{self.kafka_sasl_password_file}: {e.__class__.__name__}") from None
        value = self.environ.get(self.kafka_sasl_password_env or "")
        if not value:
            raise ConfigError(f"the Kafka SASL password env var {self.kafka_sasl_password_env} is not set")
        return value


def _settings(settings: Optional[TransportSettings]) -> TransportSettings:
    return settings if settings is not None else TransportSettings.from_env()


def kafka_python_kwargs(settings: Optional[TransportSettings] = None) -> dict:
    """Keyword arguments for kafka-python's KafkaProducer / KafkaConsumer / KafkaAdminClient."""
    s = _settings(settings)
    if s.kafka_security_protocol == "PLAINTEXT":
        return {}
    kwargs: dict = {"security_protocol": s.kafka_security_protocol}
    if s.kafka_ssl:
        kwargs["ssl_check_hostname"] = s.kafka_ssl_check_hostname
        for key, value in (("ssl_cafile", s.kafka_ssl_cafile), ("ssl_certfile", s.kafka_ssl_certfile),
                           ("ssl_keyfile", s.kafka_ssl_keyfile)):
            if value:
                kwargs[key] = value
    if s.kafka_sasl:
        kwargs.update(sasl_mechanism=s.kafka_sasl_mechanism, sasl_plain_username=s.kafka_sasl_username,
                      sasl_plain_password=s.kafka_sasl_password())
    return kwargs


def confluent_config(settings: Optional[TransportSettings] = None) -> dict:
    """librdkafka properties for confluent-kafka's Producer / Consumer / AdminClient."""
    s = _settings(settings)
    if s.kafka_security_protocol == "PLAINTEXT":
        return {}
    config: dict = {"security.protocol": s.kafka_security_protocol.lower()}
    if s.kafka_ssl:
        config["ssl.endpoint.identification.algorithm"] = "https" if s.kafka_ssl_check_hostname else "none"
        for key, value in (("ssl.ca.location", s.kafka_ssl_cafile), ("ssl.certificate.location", s.kafka_ssl_certfile),
                           ("ssl.key.location", s.kafka_ssl_keyfile)):
            if value:
                config[key] = value
    if s.kafka_sasl:
        config.update({"sasl.mechanism": s.kafka_sasl_mechanism, "sasl.username": s.kafka_sasl_username,
                       "sasl.password": s.kafka_sasl_password()})
    return config


def _jaas_quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def flink_kafka_properties(settings: Optional[TransportSettings] = None) -> dict[str, str]:
    """Java Kafka client properties for Flink's KafkaSource / KafkaSink / SQL Kafka table.

    PEM files are read by the Java client itself (`ssl.truststore.type=PEM`), so the same
    files serve both languages; they must exist at the same path on every TaskManager.
    `sasl.jaas.config` holds the password: it is a property of the job graph only.
    """
    s = _settings(settings)
    if s.kafka_security_protocol == "PLAINTEXT":
        return {}
    props = {"security.protocol": s.kafka_security_protocol}
    if s.kafka_ssl:
        if s.kafka_ssl_cafile:
            props.update({"ssl.truststore.type": "PEM", "ssl.truststore.location": s.kafka_ssl_cafile})
        if s.kafka_ssl_keyfile:
            props.update({"ssl.keystore.type": "PEM", "ssl.keystore.location": s.kafka_ssl_keyfile})
        if not s.kafka_ssl_check_hostname:
            props["ssl.endpoint.identification.algorithm"] = ""
    if s.kafka_sasl:
        module = ("org.apache.kafka.common.security.plain.PlainLoginModule" if s.kafka_sasl_mechanism == "PLAIN"
                  else "org.apache.kafka.common.security.scram.ScramLoginModule")
        props.update({"sasl.mechanism": s.kafka_sasl_mechanism,
                      "sasl.jaas.config": f"{module} required username={_jaas_quote(s.kafka_sasl_username)} "
                                          f"password={_jaas_quote(s.kafka_sasl_password())};"})
    return props


def psycopg_kwargs(settings: Optional[TransportSettings] = None) -> dict:
    """Connection parameters for psycopg.connect (they override the DSN's own)."""
    s = _settings(settings)
    kwargs = {}
    if s.pg_sslmode:
        kwargs["sslmode"] = s.pg_sslmode
    if s.pg_sslrootcert:
        kwargs["sslrootcert"] = s.pg_sslrootcert
    return kwargs


def pymongo_kwargs(settings: Optional[TransportSettings] = None) -> dict:
    """Keyword arguments for pymongo.MongoClient (unset: the URI's own ?tls=… decides)."""
    s = _settings(settings)
    kwargs: dict = {}
    if s.mongo_tls is not None:
        kwargs["tls"] = s.mongo_tls
    if s.mongo_tls_cafile:
        kwargs.update(tls=True if s.mongo_tls is None else s.mongo_tls, tlsCAFile=s.mongo_tls_cafile)
    return kwargs


def mlflow_env(settings: Optional[TransportSettings] = None) -> dict[str, str]:
    """Environment for MLflow's REST client: the CA bundle it verifies an https server with."""
    s = _settings(settings)
    return {"MLFLOW_TRACKING_SERVER_CERT_PATH": s.mlflow_ca_bundle} if s.mlflow_ca_bundle else {}


def apply_mlflow_env(settings: Optional[TransportSettings] = None) -> None:
    """Put `mlflow_env` into this process's environment (MLflow reads it per request);
    a value the deployment set itself is kept."""
    for key, value in mlflow_env(settings).items():
        os.environ.setdefault(key, value)
