"""Pipelines applied without writing a job (marker `lowcode`): `streamtune apply -f` over a
PostgreSQL table, `POST /v1/pipelines` over a Mongo collection.

The API runs as a process, as a user starts it; the CLI runs as its own process; rows go in
with psql and documents with pymongo; versions are read from MLflow through the API and
answered by `streamtune serve`. Nothing is started by hand besides the API and the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pymongo
import pytest
import requests
import yaml

from streamtune.local_job import kill_group, spawn_logged
from streamtune.pipeline import connector_name
from streamtune.stack.process import alive
from streamtune.testing import free_port, psql, save_screenshot, wait_for, wait_past_window

pytestmark = pytest.mark.lowcode
REPO = Path(__file__).resolve().parents[1]
TOKEN = "lowcode-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def streamtune(url: str, *args: str) -> dict:
    """`python -m streamtune.cli ARGS --url URL` as a user runs it; its JSON answer."""
    env = {**os.environ, "STREAMTUNE_API_TOKEN": TOKEN}
    result = subprocess.run([sys.executable, "-m", "streamtune.cli", *args, "--url", url], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (args, result.returncode, result.stderr[-3000:])
    return json.loads(result.stdout)


def capture_processes(connector: str) -> list[str]:
    """Command lines of live processes that name the pipeline's capture."""
    out = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if connector in line and " Z" not in line and "ps -eo" not in line]


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    return spawn_logged([sys.executable, "-m", "streamtune.cli", *args], log, extra_env={"STREAMTUNE_API_TOKEN": TOKEN})


def listening(url: str, proc: subprocess.Popen, log: Path, path: str) -> bool:
    assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
    try:
        return requests.get(url + path, timeout=2).status_code == 200
    except requests.RequestException:
        return False


@pytest.fixture
def page_origin(tmp_path):
    """A web page server on another origin (the API allows it): where a product's pages live."""
    import functools
    import http.server
    import threading

    site = tmp_path / "site"
    site.mkdir()
    port = free_port()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", port), functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{port}", site
    server.shutdown()


@pytest.fixture
def api(stack_config, base_model, tmp_path, page_origin):
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "api.log"
    proc = spawn_logged([sys.executable, "-m", "streamtune.cli", "api", "--port", str(port)], log,
                        extra_env={"STREAMTUNE_API_TOKEN": TOKEN, "STREAMTUNE_API_CORS_ORIGINS": page_origin[0]})
    wait_for(lambda: listening(url, proc, log, "/healthz"), 60, "the API to listen", interval=0.3)
    applied: list[str] = []
    yield url, applied
    for name in applied:  # a failed test leaves no job, capture or slot behind
        requests.delete(f"{url}/v1/pipelines/{name}", headers=AUTH, timeout=300)
    proc.terminate()  # as a user stops it: the API stops its captures on the way out
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        kill_group(proc)


@pytest.fixture
def serve(stack_config, base_model, tmp_path):
    """`streamtune serve` following the broadcast topic of pipeline `name`."""
    started = []

    def start(name: str) -> str:
        port = free_port()
        url, log = f"http://127.0.0.1:{port}", tmp_path / "serve.log"
        proc = spawn(["serve", "--port", str(port), "--base-model", str(base_model),
                      "--broadcast-topics", rf"pipeline\.{name}\.adapter-versions"], log)
        started.append(proc)
        wait_for(lambda: listening(url, proc, log, "/healthz"), 120, "the server to listen", interval=0.5)
        return url

    yield start
    for proc in started:
        kill_group(proc)


def registered_versions(api: str, model_id: str) -> list[dict]:
    """The model's MLflow versions through the API ([] before the first is registered)."""
    r = requests.get(f"{api}/v1/models/{model_id}/versions", timeout=30, headers=AUTH)
    return r.json()["versions"] if r.status_code == 200 else []


def served_version(url: str, model_id: str) -> str | None:
    """The `<id>@v<version>` a completion for the model is produced by (None before one is)."""
    r = requests.post(f"{url}/v1/completions", json={"model": model_id, "prompt": "x=1;y=", "max_tokens": 2},
                      timeout=30, headers=AUTH)
    return r.json()["system_fingerprint"] if r.status_code == 200 else None


def headless_chromium():
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1300,900"):
        options.add_argument(arg)
    options.binary_location = "/usr/bin/chromium"
    return webdriver.Chrome(options=options, service=webdriver.ChromeService("/usr/bin/chromedriver"))


def console_pause_and_resume(api: str, name: str, versions: list[dict], screenshot: Path) -> str:
    """Open /console in headless chromium, type the token, select the pipeline; check what it
    shows against the API's answers; pause and resume with its buttons. The resumed job's id."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser = headless_chromium()
    row = f'#pipelines tr[data-name="{name}"]'

    def cells(selector: str) -> list[list[str]]:  # read at once: the console redraws every 5 s
        return browser.execute_script("return [...document.querySelectorAll(arguments[0])]"
                                      ".map(tr => [...tr.cells].map(td => td.innerText))", selector)

    def job_cell() -> str:
        rows = cells(row)
        return rows[0][2] if rows else ""

    def click(xpath: str) -> None:
        for _ in range(10):
            try:
                return browser.find_element(By.XPATH, xpath).click()
            except StaleElementReferenceException:
                continue
        raise AssertionError(f"{xpath} kept being redrawn")

    try:
        browser.get(f"{api}/console")
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.ID, "refresh").click()
        WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.CSS_SELECTOR, row))
        click(f"//tr[@data-name='{name}']/td[1]")
        shown = WebDriverWait(browser, 30).until(lambda b: cells("#versions tbody tr"))
        assert [int(r[0]) for r in shown][:len(versions)] == [v["version"] for v in versions]
        assert "champion" in shown[0][2]
        assert len(browser.find_elements(By.CSS_SELECTOR, "circle.loss-point")) >= len(versions)
        assert browser.find_element(By.ID, "error").text == ""
        click(f"//tr[@data-name='{name}']//button[text()='Pause']")
        WebDriverWait(browser, 120).until(lambda b: job_cell() == "PAUSED")
        paused = requests.get(f"{api}/v1/pipelines/{name}", timeout=10, headers=AUTH).json()
        assert paused["paused"] and paused["capture"]["running"], "paused: the job stops, the capture goes on"
        click(f"//tr[@data-name='{name}']//button[text()='Resume']")
        WebDriverWait(browser, 120).until(lambda b: job_cell() == "RUNNING")
        save_screenshot(browser, screenshot)
        # A failed call is shown, not swallowed: a wrong token.
        browser.find_element(By.ID, "token").clear()
        browser.find_element(By.ID, "token").send_keys("wrong-token")
        click(f"//tr[@data-name='{name}']//button[text()='Pause']")
        WebDriverWait(browser, 30).until(lambda b: "401" in b.find_element(By.ID, "error").text)
    finally:
        browser.quit()
    state = requests.get(f"{api}/v1/pipelines/{name}", timeout=10, headers=AUTH).json()
    assert state["job_state"] == "RUNNING" and not state["paused"]
    return state["job_id"]


def test_apply_a_postgres_pipeline_rows_become_served_versions_delete_leaves_nothing(
        stack_config, api, serve, unique, tmp_path):
    api, applied = api
    dsn, table, name = stack_config.postgres_dsn, f"lc_answers_{unique.replace('-', '_')}", f"lc-pg-{unique}"
    psql(dsn, f"CREATE TABLE {table} (id int PRIMARY KEY, q text, a text, status text)")
    pipeline = {"model_id": name, "stream_source": f"postgres://127.0.0.1:{stack_config.postgres_port}/streamtune"
                                                   f"?table={table}",
                "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                "trigger_policy": {"min_samples_per_window": 3, "window_seconds": 2},
                "training": {"lr": 0.01, "micro_batch_size": 8},
                "cdc": {"prompt": "q", "completion": "a", "filter": [{"column": "status", "value": "approved"}]}}
    file = tmp_path / "pipeline.yaml"
    file.write_text(yaml.safe_dump(pipeline))

    applied.append(name)
    created = streamtune(api, "apply", "-f", str(file))
    assert created["action"] == "created" and created["job_id"]
    again = streamtune(api, "apply", "-f", str(file))
    assert again["action"] == "unchanged" and again["changes"] == [] and again["job_id"] == created["job_id"]
    state = streamtune(api, "get", "pipelines", name)
    capture_pid = state["capture"]["pid"]
    assert state["job_state"] == "RUNNING" and alive(capture_pid)

    psql(dsn, f"INSERT INTO {table} SELECT i, 'x=' || i || ';y=', (i + 1)::text, "
              f"CASE WHEN i % 4 = 0 THEN 'draft' ELSE 'approved' END FROM generate_series(1, 8) i")
    # Event time is capture time: a row captured once the first rows' window has passed closes it.
    wait_past_window(stack_config.kafka_bootstrap, f"pipeline.{name}.cdc", 2000, lambda records: len(records) >= 8)
    psql(dsn, f"INSERT INTO {table} SELECT i, 'x=9;y=', '10', 'approved' FROM generate_series(100, 102) i")
    # A partition the source reaches late can make some of rows 1-8 late for the first window:
    # they join the next one (rows 100-102's), never dropped. Either way the counts add up.
    wait_for(lambda: sum(v["samples"] or 0 for v in registered_versions(api, name)) >= 9, 120,
             "versions of rows 1-8 and 100-102 in MLflow", interval=2)
    versions = streamtune(api, "versions", name)["versions"]
    assert sum(v["samples"] or 0 for v in versions) == 9, f"rows 1-8 less the two drafts, and 100-102: {versions}"
    assert "champion" in versions[0]["aliases"]
    server = serve(name)
    assert wait_for(lambda: served_version(server, name), 60, "the version to be served", interval=1) == \
        f"{name}@v{versions[0]['version']}"

    # A changed trigger policy is a hot update: same job, same capture.
    file.write_text(yaml.safe_dump({**pipeline, "trigger_policy": {"min_samples_per_window": 2,
                                                                    "window_seconds": 2}}))
    dry = streamtune(api, "apply", "-f", str(file), "--dry-run")
    assert dry["action"] == "updated" and dry["changes"] == ["trigger_policy.min_samples_per_window: 3 -> 2"]
    assert streamtune(api, "get", "pipelines", name)["hash"] == state["hash"], "a dry run changes nothing"
    updated = streamtune(api, "apply", "-f", str(file))
    assert updated["action"] == "updated" and updated["job_id"] == created["job_id"]
    assert streamtune(api, "get", "pipelines", name)["capture"]["pid"] == capture_pid

    # The capture is supervised: killed, it runs again.
    os.kill(capture_pid, signal.SIGKILL)
    restarted = wait_for(lambda: (c := streamtune(api, "get", "pipelines", name)["capture"])["restarts"] >= 1
                         and c["running"] and c, 30, "the capture to be restarted", interval=0.5)
    assert restarted["pid"] != capture_pid

    # The web console, in a real browser: the versions, the loss curve, pause and resume.
    resumed_job = console_pause_and_resume(api, name, versions, tmp_path / "console-pipeline.png")

    deleted = streamtune(api, "delete", "-f", str(file))
    assert deleted["job_stopped"] and deleted["savepoint"] and deleted["capture_stopped"]
    assert deleted["job_id"] == resumed_job
    # The savepoint is taken when the stop returns; the job reaches FINISHED a moment later.
    state = lambda: requests.get(f"{stack_config.flink_rest_url}/jobs/{resumed_job}", timeout=5).json()["state"]  # noqa: E731
    wait_for(lambda: state() in ("FINISHED", "FAILED", "CANCELED"), 60, "the stopped job to end", interval=0.5)
    assert state() == "FINISHED", "stopped with a savepoint"
    assert not alive(restarted["pid"]) and capture_processes(connector_name(name)) == [], "no capture left behind"
    assert psql(dsn, f"SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{connector_name(name)}'"
                ).strip() == "0", "the slot is dropped: the server keeps no WAL for a deleted pipeline"
    assert streamtune(api, "get", "pipelines") == [] or name not in {p["name"] for p in
                                                                    streamtune(api, "get", "pipelines")}


@pytest.mark.slow  # CI time: the PostgreSQL pipeline covers the same control-plane path
def test_post_a_mongo_pipeline_documents_become_versions(stack_config, api, unique):
    api, applied = api
    db, name = f"lc_{unique.replace('-', '_')}", f"lc-mongo-{unique}"
    mongo = pymongo.MongoClient(stack_config.mongo_uri)
    mongo[db].create_collection("reviews")
    pipeline = {"model_id": name, "stream_source": f"mongodb://127.0.0.1:{stack_config.mongo_port}/"
                                                   f"?db={db}&collection=reviews",
                "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                "trigger_policy": {"min_samples_per_window": 3, "window_seconds": 2},
                "training": {"lr": 0.01, "micro_batch_size": 8},
                "cdc": {"prompt": "text", "completion": "reply.body"}}
    applied.append(name)
    r = requests.post(f"{api}/v1/pipelines", json=pipeline, headers=AUTH, timeout=120)
    assert r.status_code == 201, r.text
    assert requests.post(f"{api}/v1/pipelines", json=pipeline, headers=AUTH, timeout=120).json()["action"] == \
        "unchanged"
    assert requests.post(f"{api}/v1/pipelines", json=pipeline, timeout=10).status_code == 401
    wait_for(lambda: requests.get(f"{api}/v1/pipelines/{name}", timeout=10, headers=AUTH).json()["capture"]["running"], 30,
             "the capture to run")
    connector = connector_name(name)
    wait_for(lambda: "capturing" in Path(requests.get(f"{api}/v1/pipelines/{name}", timeout=10, headers=AUTH).json()
                                         ["capture"]["log"]).read_text(), 60, "the change stream to open")
    mongo[db].reviews.insert_many([{"_id": i, "text": f"x={i};y=", "reply": {"body": str(i + 1)}} for i in range(5)])
    wait_past_window(stack_config.kafka_bootstrap, f"pipeline.{name}.cdc", 2000, lambda records: len(records) >= 5)
    mongo[db].reviews.insert_one({"_id": 99, "text": "x=9;y=", "reply": {"body": "10"}})
    assert wait_for(lambda: registered_versions(api, name), 120, "a version in MLflow", interval=2)[0]["samples"] == 5
    r = requests.delete(f"{api}/v1/pipelines/{name}", headers=AUTH, timeout=300)
    assert r.status_code == 200 and r.json()["job_stopped"] and r.json()["capture_stopped"], r.text
    assert capture_processes(connector) == []
    mongo.close()


def test_feedback_hook_on_another_origin_posts_batched_events_for_a_response(stack_config, api, page_origin, unique):
    """The copy-paste snippet on a page of another origin: three events for one served
    response reach the pipeline's feedback topic as samples citing the response id."""
    from selenium.webdriver.support.ui import WebDriverWait

    from connectors.kafka import read_topic
    from core.messages import FeedbackSample

    api, applied = api
    origin, site = page_origin
    name, topic = f"lc-fb-{unique}", f"test.lc-fb-{unique}"
    pipeline = {"model_id": name, "stream_source": f"kafka://topic={topic}",
                "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]},
                "trigger_policy": {"min_samples_per_window": 8, "window_seconds": 2}}
    applied.append(name)
    r = requests.post(f"{api}/v1/pipelines", json=pipeline, headers=AUTH, timeout=300)
    assert r.status_code == 201 and r.json()["action"] == "created", r.text
    (site / "index.html").write_text(
        f'<!doctype html><title>a product page</title>'
        f'<script src="{api}/feedback.js" data-api="{api}" data-token="{TOKEN}"></script>')
    served = {"id": f"cmpl-{unique}", "model": f"{name}@champion", "choices": [{"text": "42"}]}
    browser = headless_chromium()
    try:
        browser.get(f"{origin}/index.html")
        WebDriverWait(browser, 30).until(lambda b: b.execute_script("return !!window.streamtune"))
        browser.execute_script("const r = arguments[0];"
                               "streamtune.click(r, 'x=41;y='); streamtune.dwell(r, 'x=41;y=', 12.5);"
                               "streamtune.correction(r, 'x=41;y=', '43'); streamtune.flush();", served)
        WebDriverWait(browser, 30).until(lambda b: b.execute_script("return streamtune.pending()") == 0)
    finally:
        browser.quit()
    samples = [FeedbackSample.from_json(rec.value) for rec in read_topic(stack_config.kafka_bootstrap, topic,
                                                                          expect=3, timeout=30)]
    assert sorted((s.label, s.completion, s.request_id, s.model_id) for s in samples) == [
        ("accepted", "42", served["id"], name), ("accepted", "42", served["id"], name),
        ("corrected", "43", served["id"], name)]
    assert len({s.sample_id for s in samples}) == 3
