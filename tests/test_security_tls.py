"""Encrypted transport (core/transport.py): what each client is handed, over real TLS where
the local services can do it.

- PostgreSQL: the test makes a CA and a server certificate, starts its own small PostgreSQL
  with ssl=on, and connects through streamtune's capture (connectors/postgres_wal.py) with
  STREAMTUNE_PG_SSLMODE=verify-full: every connection is encrypted, and a server the CA did not
  sign is refused. With the defence off (sslmode=disable / require) the same code talks in
  plaintext / to an unverified server: the assertions of the "on" case fail there.
- MLflow: a TLS proxy in front of the stack's MLflow; streamtune's registry client reaches it
  with STREAMTUNE_MLFLOW_CA_BUNDLE and fails without it.
- Kafka and MongoDB: the local stand-ins (Tansu, secantusdb) speak plaintext only, so the
  rendered client settings are checked for each mode instead, and the SASL password is shown
  to stay out of reprs, errors and every rendered setting but the one that must carry it.
"""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import os
import pwd
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psycopg
import pytest

from core import transport
from core.errors import ConfigError
from core.transport import TransportSettings

pytestmark = [pytest.mark.security]

PG_BIN = Path("/usr/lib/postgresql/15/bin")
MLFLOW = ("127.0.0.1", 5000)


# -- certificates ----------------------------------------------------------------------------
def _make_ca(name: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _server_cert(ca_key, ca_cert):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def _pem(obj) -> bytes:
    from cryptography.hazmat.primitives import serialization

    if hasattr(obj, "public_bytes") and not hasattr(obj, "private_bytes"):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@pytest.fixture(scope="module")
def certs():
    pytest.importorskip("cryptography")
    root = Path(tempfile.mkdtemp(prefix="streamtune-tls-"))
    root.chmod(0o755)  # the postgres user reads the server's files
    ca_key, ca_cert = _make_ca("streamtune test CA")
    _, wrong_cert = _make_ca("somebody else's CA")
    key, cert = _server_cert(ca_key, ca_cert)
    files = {"ca": root / "ca.pem", "wrong_ca": root / "wrong-ca.pem", "cert": root / "server.pem",
             "key": root / "server.key"}
    files["ca"].write_bytes(_pem(ca_cert))
    files["wrong_ca"].write_bytes(_pem(wrong_cert))
    files["cert"].write_bytes(_pem(cert))
    files["key"].write_bytes(_pem(key))
    files["key"].chmod(0o600)
    yield root, files
    shutil.rmtree(root, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- PostgreSQL over TLS ---------------------------------------------------------------------
def _as_postgres(cmd: list[str]) -> subprocess.CompletedProcess:
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def tls_postgres(certs):
    if not (PG_BIN / "initdb").exists():
        pytest.skip("PostgreSQL 15 binaries are not installed")
    root, files = certs
    data = root / "pgdata"
    data.mkdir()
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        for path in (data, files["key"], files["cert"]):
            os.chown(path, pw.pw_uid, pw.pw_gid)
    r = _as_postgres([str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                      "--locale=C.UTF-8"])
    assert r.returncode == 0, r.stderr[-1000:]
    port = _free_port()
    with open(data / "postgresql.conf", "a") as conf:
        conf.write(f"\nssl = on\nssl_cert_file = '{files['cert']}'\nssl_key_file = '{files['key']}'\n"
                   "wal_level = logical\nmax_replication_slots = 4\nmax_wal_senders = 4\n"
                   "shared_buffers = 16MB\nfsync = off\n")
    r = _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(data / "server.log"), "-o",
                      f"-p {port} -h 127.0.0.1 -k {data}", "-w", "-t", "30", "start"])
    assert r.returncode == 0, r.stdout[-1500:] + (data / "server.log").read_text()[-1500:]
    try:
        with psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=postgres", autocommit=True) as conn:
            conn.execute("CREATE TABLE feedback (id int PRIMARY KEY, prompt text)")
        yield f"host=localhost port={port} user=postgres dbname=postgres", files
    finally:
        _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"])


def _encrypted_backends(dsn: str) -> dict[str, bool]:
    """backend type -> whether every such connection (but this one) is encrypted."""
    with psycopg.connect(dsn, **transport.psycopg_kwargs()) as conn:
        rows = conn.execute("SELECT a.backend_type, bool_and(s.ssl) FROM pg_stat_ssl s JOIN pg_stat_activity a "
                            "USING (pid) WHERE s.pid <> pg_backend_pid() AND a.backend_type IN "
                            "('client backend', 'walsender') GROUP BY 1").fetchall()
    return dict(rows)


@pytest.mark.parametrize("defence", ["on", "off"])
def test_capture_connects_to_postgres_over_verified_tls(tls_postgres, monkeypatch, unique, defence):
    from connectors.postgres_wal import PostgresWal

    dsn, files = tls_postgres
    if defence == "on":
        monkeypatch.setenv("STREAMTUNE_PG_SSLMODE", "verify-full")
        monkeypatch.setenv("STREAMTUNE_PG_SSLROOTCERT", str(files["ca"]))
    else:  # for the test only: what a client without the setting does
        monkeypatch.setenv("STREAMTUNE_PG_SSLMODE", "disable")
    wal = PostgresWal(dsn, ["public.feedback"], name=f"tls_{unique}")
    wal.prepare()  # publications and slot over a normal connection; the replication connection stays open
    try:
        encrypted = _encrypted_backends(dsn)
        assert encrypted.get("walsender") is (defence == "on"), encrypted
    finally:
        wal._repl.close()
        wal.drop_slot()


@pytest.mark.parametrize("sslmode", ["verify-full", "require"])
def test_a_server_the_ca_did_not_sign_is_refused(tls_postgres, monkeypatch, unique, sslmode):
    """verify-full with a CA that did not sign the server: refused (a man in the middle is
    refused the same way). `require` (defence off) encrypts but checks nobody: it connects."""
    from connectors.postgres_wal import PostgresWal

    dsn, files = tls_postgres
    monkeypatch.setenv("STREAMTUNE_PG_SSLMODE", sslmode)
    if sslmode == "verify-full":
        monkeypatch.setenv("STREAMTUNE_PG_SSLROOTCERT", str(files["wrong_ca"]))
    else:  # libpq treats `require` with a root certificate as verify-ca: without one it checks nothing
        monkeypatch.delenv("STREAMTUNE_PG_SSLROOTCERT", raising=False)
    wal = PostgresWal(dsn, ["public.feedback"], name=f"tls_{unique}")
    if sslmode == "verify-full":
        with pytest.raises(psycopg.OperationalError, match="certificate verify failed"):
            wal.prepare()
    else:
        wal.prepare()
        wal._repl.close()
        wal.drop_slot()


# -- MLflow behind HTTPS ---------------------------------------------------------------------
class _Forward(BaseHTTPRequestHandler):
    """Forwards every request to the stack's MLflow over plain HTTP on loopback."""

    def _forward(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        upstream = http.client.HTTPConnection(*MLFLOW, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        upstream.request(self.command, self.path, body=body or None, headers=headers)
        answer = upstream.getresponse()
        payload = answer.read()
        self.send_response(answer.status)
        for k, v in answer.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
        upstream.close()

    do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _forward

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def https_mlflow(certs):
    try:
        http.client.HTTPConnection(*MLFLOW, timeout=3).request("GET", "/health")
    except OSError:
        pytest.skip("the stack's MLflow is not up")
    _, files = certs
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Forward)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files["cert"], files["key"])
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://localhost:{server.server_address[1]}", files
    server.shutdown()


@pytest.mark.parametrize("defence", ["on", "off"])
def test_registry_client_reaches_mlflow_over_https_with_the_ca_bundle(https_mlflow, monkeypatch, defence):
    from mlflow.exceptions import MlflowException

    from connectors.mlflow_registry import find_version, make_client

    url, files = https_mlflow
    monkeypatch.delenv("MLFLOW_TRACKING_SERVER_CERT_PATH", raising=False)  # undone after the test
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    if defence == "on":
        monkeypatch.setenv("STREAMTUNE_MLFLOW_CA_BUNDLE", str(files["ca"]))
    else:
        monkeypatch.delenv("STREAMTUNE_MLFLOW_CA_BUNDLE", raising=False)
    client = make_client(url)
    if defence == "on":
        assert find_version(client, "no-such-model-tls", "v1") is None  # a real round trip through TLS
    else:
        with pytest.raises((MlflowException, OSError), match="(?i)certificate|SSL"):
            find_version(client, "no-such-model-tls", "v1")


# -- Kafka and MongoDB: rendered settings (the local stand-ins speak plaintext only) ---------
SECRET = "pa'ss\"w0rd-kafka-7f3c"


def _kafka_env(tmp_path: Path, protocol: str, mechanism: str | None, ca: Path | None) -> dict[str, str]:
    env = {"STREAMTUNE_KAFKA_SECURITY_PROTOCOL": protocol}
    if ca is not None:
        env["STREAMTUNE_KAFKA_SSL_CAFILE"] = str(ca)
    if mechanism:
        secret_file = tmp_path / "kafka-password"
        secret_file.write_text(SECRET + "\n")
        env.update({"STREAMTUNE_KAFKA_SASL_MECHANISM": mechanism, "STREAMTUNE_KAFKA_SASL_USERNAME": "trainer",
                    "STREAMTUNE_KAFKA_SASL_PASSWORD_FILE": str(secret_file)})
    return env


@pytest.mark.parametrize("protocol,mechanism", [("PLAINTEXT", None), ("SSL", None), ("SASL_PLAINTEXT", "PLAIN"),
                                                ("SASL_SSL", "SCRAM-SHA-256"), ("SASL_SSL", "SCRAM-SHA-512")])
def test_kafka_client_settings_for_each_mode(certs, tmp_path, protocol, mechanism):
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

    _, files = certs
    ssl_on = "SSL" in protocol.replace("SASL_", "") or protocol == "SASL_SSL"
    s = TransportSettings.from_env(_kafka_env(tmp_path, protocol, mechanism, files["ca"] if ssl_on else None))

    kp = transport.kafka_python_kwargs(s)
    for client in (KafkaProducer, KafkaConsumer, KafkaAdminClient):  # names the constructors accept
        assert set(kp) <= set(client.DEFAULT_CONFIG), set(kp) - set(client.DEFAULT_CONFIG)
    cc = transport.confluent_config(s)
    fp = transport.flink_kafka_properties(s)
    if protocol == "PLAINTEXT":
        assert kp == cc == fp == {}  # today's behaviour on the local stack
        return
    assert kp["security_protocol"] == protocol and cc["security.protocol"] == protocol.lower()
    assert fp["security.protocol"] == protocol
    if ssl_on:
        ssl.create_default_context(cafile=kp["ssl_cafile"])  # the file is a usable CA bundle
        assert cc["ssl.ca.location"] == str(files["ca"])
        assert fp["ssl.truststore.type"] == "PEM" and fp["ssl.truststore.location"] == str(files["ca"])
    else:
        assert not any(k.startswith("ssl") for k in (*kp, *cc, *fp))
    if mechanism:
        assert kp["sasl_mechanism"] == cc["sasl.mechanism"] == fp["sasl.mechanism"] == mechanism
        assert kp["sasl_plain_password"] == cc["sasl.password"] == SECRET
        module = "PlainLoginModule" if mechanism == "PLAIN" else "ScramLoginModule"
        jaas = fp["sasl.jaas.config"]
        assert module in jaas and 'username="trainer"' in jaas and 'password="pa\'ss\\"w0rd-kafka-7f3c"' in jaas
        # The only Flink property that holds the password is the JAAS config.
        assert [k for k, v in fp.items() if "w0rd-kafka" in v] == ["sasl.jaas.config"]
        assert SECRET not in repr(s) and "w0rd" not in repr(s)


def test_flink_kafka_table_and_sinks_carry_the_properties_not_the_command_line(certs, tmp_path, monkeypatch):
    """The SQL table's DDL (executed inside the job's client, never an argument) carries the
    properties, SQL-quoted; nothing else in it holds the password."""
    from connectors.flink_kafka import input_table_ddl

    for key, value in _kafka_env(tmp_path, "SASL_SSL", "PLAIN", certs[1]["ca"]).items():
        monkeypatch.setenv(key, value)
    ddl = input_table_ddl("t", ["feedback"], "broker:9093", "g", 0, 2000, {"fetch.max.wait.ms": "20"})
    assert "'properties.security.protocol' = 'SASL_SSL'" in ddl
    assert "'properties.ssl.truststore.type' = 'PEM'" in ddl
    lines = [line for line in ddl.splitlines() if "w0rd-kafka" in line]
    assert len(lines) == 1 and lines[0].strip().startswith("'properties.sasl.jaas.config'")
    assert "pa''ss" in lines[0]  # the quote in the password does not end the SQL string
    # The password is not in this process's command line (it came from a file).
    assert "w0rd-kafka" not in Path("/proc/self/cmdline").read_text()


def test_settings_errors_never_show_the_password(tmp_path):
    env = _kafka_env(tmp_path, "SASL_SSL", "PLAIN", None)
    del env["STREAMTUNE_KAFKA_SASL_USERNAME"]
    with pytest.raises(ConfigError) as e:
        TransportSettings.from_env(env)
    assert "w0rd" not in str(e.value)
    with pytest.raises(ConfigError, match="PASSWORD_FILE or STREAMTUNE_KAFKA_SASL_PASSWORD_ENV"):
        TransportSettings.from_env({"STREAMTUNE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
                                    "STREAMTUNE_KAFKA_SASL_USERNAME": "u"})
    with pytest.raises(ConfigError, match="expected one of"):
        TransportSettings.from_env({"STREAMTUNE_KAFKA_SECURITY_PROTOCOL": "TLS"})


@pytest.mark.parametrize("mode", ["unset", "tls-ca", "off"])
def test_mongo_client_settings_for_each_mode(certs, mode):
    import pymongo

    _, files = certs
    env = {"unset": {}, "off": {"STREAMTUNE_MONGO_TLS": "false"},
           "tls-ca": {"STREAMTUNE_MONGO_TLS": "true", "STREAMTUNE_MONGO_TLS_CAFILE": str(files["ca"])}}[mode]
    kwargs = transport.pymongo_kwargs(TransportSettings.from_env(env))
    assert kwargs == {"unset": {}, "off": {"tls": False},
                      "tls-ca": {"tls": True, "tlsCAFile": str(files["ca"])}}[mode]
    # pymongo accepts them (and loads the CA file) without connecting.
    client = pymongo.MongoClient("mongodb://127.0.0.1:1/?directConnection=true", connect=False,
                                 serverSelectionTimeoutMS=100, **kwargs)
    client.close()
