"""The console's pipeline editor, end to end in headless chromium (marker `console`).

The API runs as a process with a token, as a user starts it; the browser signs in, writes a
pipeline over a real source (a PostgreSQL table made with psql, a Kafka topic fed with JSON
records), reads the source's fields and records in the preview (with the sample each record
makes, or the dead-letter reason it would get), reviews the dry run's diff, applies, and waits
for the pipeline's first version on the models list. The YAML the editor downloads, applied
with `streamtune apply -f`, is `unchanged`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from streamtune.local_job import kill_group, spawn_logged
from streamtune.pipeline import connector_name
from streamtune.testing import free_port, psql, save_screenshot, wait_for, wait_past_window
from test_lowcode import listening

pytestmark = pytest.mark.console
TOKEN = "console-editor-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def api(stack_config, base_model, tmp_path):
    """`streamtune api` as a process; every pipeline it was given is deleted afterwards."""
    port = free_port()
    url, log = f"http://127.0.0.1:{port}", tmp_path / "api.log"
    proc = spawn_logged([sys.executable, "-m", "streamtune.cli", "api", "--port", str(port)], log,
                        extra_env={"STREAMTUNE_API_TOKEN": TOKEN})
    wait_for(lambda: listening(url, proc, log, "/healthz"), 60, "the API to listen", interval=0.3)
    applied: list[str] = []
    yield url, applied
    for name in applied:  # a failed test leaves no job, capture or slot behind
        requests.delete(f"{url}/v1/pipelines/{name}", headers=AUTH, timeout=300)
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        kill_group(proc)


@pytest.fixture
def browser(tmp_path):
    """Headless chromium at 1280×800 that saves downloads to tmp_path/downloads."""
    from selenium import webdriver

    downloads = tmp_path / "downloads"
    downloads.mkdir()
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,800"):
        options.add_argument(arg)
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    options.binary_location = "/usr/bin/chromium"
    b = webdriver.Chrome(options=options, service=webdriver.ChromeService("/usr/bin/chromedriver"))
    b.set_window_size(1280, 800)
    b.downloads = downloads
    yield b
    b.quit()


# ---------------------------------------------------------------- the editor, as a user drives it

def by(css: str):
    from selenium.webdriver.common.by import By

    return By.CSS_SELECTOR, css


def until(browser, condition, timeout: float = 30, what: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout, poll_frequency=0.2).until(condition, what)


def fill(browser, css: str, text) -> None:
    field = browser.find_element(*by(css))
    field.clear()
    field.send_keys(str(text))


def sign_in(browser, api: str) -> None:
    browser.get(f"{api}/console")
    fill(browser, "#token", TOKEN)
    browser.find_element(*by("#refresh")).click()
    until(browser, lambda b: b.find_element(*by("#updated")).text, what="a refresh with the token")


def open_new_pipeline(browser, model_id: str, kind: str) -> None:
    from selenium.webdriver.support.ui import Select

    browser.find_element(*by("#new-pipeline")).click()
    until(browser, lambda b: b.find_element(*by("#editor-form")).is_displayed())
    fill(browser, "#ed-model-id", model_id)
    Select(browser.find_element(*by("#ed-kind"))).select_by_value(kind)


def set_policy(browser, min_samples: int, window_seconds: int) -> None:
    fill(browser, "#ed-rank", 4)
    fill(browser, "#ed-alpha", 8)
    fill(browser, "#ed-modules", "q_proj, v_proj")
    fill(browser, "#ed-min-samples", min_samples)
    fill(browser, "#ed-window", window_seconds)
    fill(browser, "#ed-advanced", '{"training": {"lr": 0.01, "micro_batch_size": 8}}')


def preview_rows(browser) -> list[dict]:
    """The preview table at once (it redraws as the spec changes)."""
    return browser.execute_script(
        "return [...document.querySelectorAll('#ed-preview-table tbody tr')].map(tr => ({outcome: tr.dataset.outcome,"
        " cells: [...tr.cells].map(c => c.innerText)}))")


def review_and_apply(browser, model_id: str) -> list[str]:
    """Review changes (the dry run's diff), then Apply; the diff shown before applying."""
    browser.find_element(*by("#ed-dry-run")).click()
    until(browser, lambda b: f"would leave {model_id} created" in b.find_element(*by("#ed-diff")).text,
          what="the dry run's diff")
    diff = [li.text for li in browser.find_elements(*by("#ed-diff li"))]
    apply = browser.find_element(*by("#ed-apply"))
    assert apply.is_enabled()
    apply.click()
    until(browser, lambda b: f"Applied: {model_id} created" in b.find_element(*by("#ed-diff")).text, 300,
          "the pipeline to be applied")
    return diff


def wait_for_first_version(browser, model_id: str) -> list[str]:
    """The models list (redrawn every 5 s) shows the model once its first version is registered."""
    fill(browser, "#model-filter", model_id)

    def newest_version():  # the model may be listed before it has a version
        cells = browser.execute_script("const r = document.querySelector(arguments[0]);"
                                       "return r && [...r.cells].map(c => c.innerText)",
                                       f'#models tr[data-model="{model_id}"]')
        return cells and cells[3] != "–" and cells
    return until(browser, lambda b: newest_version(), 240, f"{model_id}'s first version on the models list")


def download_and_apply(browser, api: str, model_id: str) -> str:
    """Edit the applied pipeline (its spec loaded into the form), download it as YAML, and
    apply that file with the CLI; the CLI's output."""
    edit = f'#pipelines tr[data-name="{model_id}"] button'
    until(browser, lambda b: b.find_elements(*by(edit)), what="the pipeline listed with its Edit button")
    browser.find_element(*by(edit)).click()   # the first button of the row: Edit
    until(browser, lambda b: b.find_element(*by("#ed-model-id")).get_attribute("value") == model_id
          and b.find_element(*by("#ed-model-id")).get_attribute("readonly"), what="the spec loaded for editing")
    browser.find_element(*by("#ed-download")).click()
    file = browser.downloads / f"{model_id}.yaml"
    wait_for(lambda: file.exists() and file.stat().st_size > 0, 30, "the YAML download", interval=0.2)
    env = {**os.environ, "STREAMTUNE_API_TOKEN": TOKEN}
    out = subprocess.run([sys.executable, "-m", "streamtune.cli", "apply", "-f", str(file), "--url", api],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


# ---------------------------------------------------------------- PostgreSQL

def test_editor_writes_a_postgres_pipeline_from_a_previewed_table(stack_config, api, browser, unique, tmp_path):
    api, applied = api
    dsn, table, name = stack_config.postgres_dsn, f"ed_answers_{unique}", f"ed-pg-{unique}"
    psql(dsn, f"CREATE TABLE {table} (id int PRIMARY KEY, q text, a text, score float8, status text)")
    psql(dsn, f"INSERT INTO {table} VALUES (1, 'x=1;y=', '2', 1, 'approved'), (2, 'x=2;y=', NULL, 1, 'approved'), "
              f"(3, 'x=3;y=', '4', 1, 'draft')")
    sign_in(browser, api)
    open_new_pipeline(browser, name, "postgres")

    # An unknown table: the API's 404, beside the source.
    fill(browser, "#ed-port", stack_config.postgres_port)
    fill(browser, "#ed-db", "streamtune")
    fill(browser, "#ed-table", f"{table}_missing")
    browser.find_element(*by("#ed-read")).click()
    until(browser, lambda b: f"{table}_missing does not exist" in b.find_element(*by("#err-stream_source")).text,
          what="the unknown table's error beside the source")

    fill(browser, "#ed-table", table)
    browser.find_element(*by("#ed-read")).click()
    until(browser, lambda b: len(preview_rows(b)) == 3, what="the table's rows in the preview")
    fields = [b.get_attribute("data-field") for b in browser.find_elements(*by("#ed-fields button"))]
    assert fields == ["id", "q", "a", "score", "status"]
    # No templates yet: the rows are read, and the spec's gaps are said beside their fields.
    assert "at least 1 character" in browser.find_element(*by("#err-cdc\\.prompt")).text

    # The prompt from a field's button (into the template last in), from the keyboard; the
    # completion typed.
    from selenium.webdriver.common.keys import Keys

    browser.find_element(*by("#ed-prompt")).click()
    browser.find_element(*by('#ed-fields button[data-field="q"]')).send_keys(Keys.ENTER)
    assert browser.find_element(*by("#ed-prompt")).get_attribute("value") == "{q}"
    fill(browser, "#ed-completion", "{a}")
    fill(browser, "#ed-weight", "score")
    browser.find_element(*by("#ed-add-filter")).click()
    fill(browser, "#ed-filters > div:last-child .column", "status")
    fill(browser, "#ed-filters > div:last-child .value", "approved")
    set_policy(browser, min_samples=3, window_seconds=2)
    browser.find_element(*by("#ed-preview")).click()

    def mapped():
        rows = {r["cells"][0]: r for r in preview_rows(browser)}
        return len(rows) == 3 and all(r["outcome"] != "unchecked" for r in rows.values()) and rows
    rows = until(browser, lambda b: mapped(), what="each row's sample or dead-letter reason")
    by_id = {json.loads(text)["id"]: r for text, r in rows.items()}
    assert by_id[1]["outcome"] == "sample" and by_id[1]["cells"][2:] == ["x=1;y=", "2", "1"], by_id[1]
    assert by_id[2]["outcome"] == "dead_letter"
    assert "unmappable" in by_id[2]["cells"][1] and "field 'a' is missing or null" in by_id[2]["cells"][1]
    assert by_id[3]["outcome"] == "filtered"
    assert browser.find_element(*by("#ed-form-error")).text == ""
    browser.execute_script("document.querySelector('#ed-mapping').scrollIntoView()")
    save_screenshot(browser, tmp_path / "console-editor-preview.png")

    applied.append(name)
    diff = review_and_apply(browser, name)
    assert f'model_id: null -> "{name}"' in diff, diff
    assert any(c.startswith("cdc: null -> ") and '"prompt": "{q}"' in c and '"completion": "{a}"' in c for c in diff)

    # Rows inserted once the capture's slot exists become samples: 6 approved, then one closer.
    slot = connector_name(name)
    wait_for(lambda: psql(dsn, f"SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{slot}'").strip() == "1",
             60, "the capture's replication slot", interval=0.3)
    psql(dsn, f"INSERT INTO {table} SELECT i, 'x=' || i || ';y=', (i + 1)::text, 1, 'approved' "
              f"FROM generate_series(10, 15) i")
    wait_past_window(stack_config.kafka_bootstrap, f"pipeline.{name}.cdc", 2000, lambda records: len(records) >= 6)
    psql(dsn, f"INSERT INTO {table} VALUES (100, 'x=9;y=', '10', 1, 'approved')")
    cells = wait_for_first_version(browser, name)
    assert cells[0] == name and cells[3] == "v1" and cells[5] == name, cells
    save_screenshot(browser, tmp_path / "console-editor-applied.png")
    # The job mapped the rows with the same templates: the six rows of the window, none dead-lettered.
    versions = requests.get(f"{api}/v1/models/{name}/versions", headers=AUTH, timeout=30).json()["versions"]
    assert versions[0]["samples"] == 6, versions[0]

    out = download_and_apply(browser, api, name)
    assert json.loads(out)["action"] == "unchanged", out


# ---------------------------------------------------------------- Kafka

def test_editor_writes_a_kafka_pipeline_from_a_previewed_topic(stack_config, api, browser, unique, tmp_path):
    from kafka import KafkaProducer

    from connectors.kafka import create_topic

    api, applied = api
    name, topic = f"ed-kafka-{unique}", f"test.ed-kafka-{unique}"
    create_topic(stack_config.kafka_bootstrap, topic)
    producer = KafkaProducer(bootstrap_servers=stack_config.kafka_bootstrap, acks="all")

    def send(value: dict, ts: int) -> None:
        producer.send(topic, json.dumps(value).encode(), timestamp_ms=ts)

    now = int(time.time() * 1000)
    send({"model_id": name, "sample_id": "s1", "prompt": "x=1;y=", "completion": "2", "ts": now}, now)
    send({"model_id": name, "sample_id": "s2", "prompt": "x=2;y=", "ts": now}, now)   # no completion
    send({"model_id": name, "sample_id": "s3", "prompt": "x=3;y=", "completion": "4", "ts": now}, now)
    producer.flush()

    sign_in(browser, api)
    open_new_pipeline(browser, name, "kafka")
    assert not browser.find_element(*by("#ed-prompt")).is_displayed(), "a topic's records are samples already"
    fill(browser, "#ed-topic", topic)
    set_policy(browser, min_samples=2, window_seconds=2)
    browser.find_element(*by("#ed-read")).click()
    until(browser, lambda b: len(preview_rows(b)) == 3, what="the topic's records in the preview")
    rows = {json.loads(r["cells"][0])["sample_id"]: r for r in preview_rows(browser)}
    assert rows["s1"]["outcome"] == "sample" and rows["s1"]["cells"][2:] == ["x=1;y=", "2", "1"], rows["s1"]
    assert rows["s2"]["outcome"] == "dead_letter" and "completion: Field required" in rows["s2"]["cells"][1], rows
    assert rows["s3"]["outcome"] == "sample"
    fields = [b.get_attribute("data-field") for b in browser.find_elements(*by("#ed-fields button"))]
    assert fields == ["model_id", "sample_id", "prompt", "completion", "ts"]
    save_screenshot(browser, tmp_path / "console-editor-kafka.png")

    # Evaluation and replay are form fields: a value out of range is refused beside its field,
    # nothing applied; the replay settings reach the applied spec.
    fill(browser, "#ed-holdout", 2)
    browser.find_element(*by("#ed-dry-run")).click()
    until(browser, lambda b: "less than 1" in b.find_element(*by("#err-evaluation\\.holdout_fraction")).text,
          what="the held-out fraction's error beside it")
    assert browser.find_element(*by("#ed-holdout")).get_attribute("aria-invalid") == "true"
    browser.find_element(*by("#ed-holdout")).clear()
    fill(browser, "#ed-replay-buffer", 64)
    fill(browser, "#ed-replay-ratio", 0.5)

    applied.append(name)
    diff = review_and_apply(browser, name)
    assert f'stream_source: null -> "kafka://topic={topic}"' in diff, diff
    spec_applied = requests.get(f"{api}/v1/pipelines/{name}", headers=AUTH, timeout=30).json()["pipeline"]
    assert spec_applied["replay"] == {"buffer_size": 64, "ratio": 0.5} and spec_applied.get("evaluation") is None, \
        spec_applied
    wait_for(lambda: requests.get(f"{api}/v1/pipelines/{name}", headers=AUTH, timeout=30).json()["job_state"]
             == "RUNNING", 180, "the pipeline's job to run", interval=1)

    # Samples in one 2 s window, then a closer in a later one: the window closes, a version.
    t0 = (int(time.time() * 1000) // 2000 + 1) * 2000
    for i in range(3):
        send({"model_id": name, "sample_id": f"w{i}", "prompt": f"x={i};y=", "completion": str(i + 1),
              "ts": t0 + i * 100}, t0 + i * 100)
    send({"model_id": name, "sample_id": "closer", "prompt": "x=7;y=", "completion": "8", "ts": t0 + 12_000},
         t0 + 12_000)
    producer.flush()
    producer.close()
    # The previewed records' window and this one: a version each; the list may show either first.
    cells = wait_for_first_version(browser, name)
    assert cells[0] == name and cells[3] in ("v1", "v2") and cells[5] == name, cells

    out = download_and_apply(browser, api, name)
    assert json.loads(out)["action"] == "unchanged", out


# ---------------------------------------------------------------- the preview route's answers

def test_preview_reads_a_mongo_collection_and_answers_bad_sources_clearly(stack_config, unique, tmp_path):
    """In process, against the stack's real servers: a collection's documents through the
    mapping (dotted paths, templates); an unknown table or collection 404, an unreachable
    server 503, a malformed URI 422, each naming the source; admin scope only."""
    import pymongo
    from fastapi.testclient import TestClient

    from streamtune.api.app import ApiSettings, create_app

    client = TestClient(create_app(ApiSettings(stack=stack_config, token=TOKEN, jobs_file=tmp_path / "jobs.json")))
    db, coll = f"ed_{unique}", "answers"
    mongo = pymongo.MongoClient(f"mongodb://127.0.0.1:{stack_config.mongo_port}/?directConnection=true")
    try:
        mongo[db][coll].insert_many([{"q": "x=1;y=", "reply": {"body": "2"}, "w": 2}, {"q": "x=2;y="}])
        source = f"mongodb://127.0.0.1:{stack_config.mongo_port}/?db={db}&collection={coll}"
        pipeline = {"model_id": f"ed-mongo-{unique}", "stream_source": source,
                    "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]},
                    "trigger_policy": {"min_samples_per_window": 2, "window_seconds": 2},
                    "cdc": {"prompt": "Q: {q}", "completion": "reply.body", "weight": "w"}}

        def preview(spec: dict, auth=AUTH):
            return client.post("/v1/pipelines/preview", json={"pipeline": spec, "limit": 5}, headers=auth)

        r = preview(pipeline)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert [(f["name"], f["type"]) for f in answer["fields"]] == [
            ("_id", "object"), ("q", "string"), ("reply", "object"), ("reply.body", "string"), ("w", "number")]
        assert [(x["outcome"], x["sample"], x["reason"], x["detail"]) for x in answer["records"]] == [
            ("sample", {"prompt": "Q: x=1;y=", "completion": "2", "weight": 2.0}, None, None),
            ("dead_letter", None, "unmappable", "field 'reply.body' is missing or null")]
        assert answer["spec_errors"] == []

        # Unfinished: the documents all the same, the spec's gaps by field.
        r = preview({"stream_source": source})
        assert r.status_code == 200 and {x["outcome"] for x in r.json()["records"]} == {"unchecked"}
        assert {"model_id", "adapter_config", "trigger_policy"} <= {e["field"] for e in r.json()["spec_errors"]}

        def error(spec: dict, status: int) -> str:
            r = preview(spec)
            assert r.status_code == status, r.text
            detail = r.json()["detail"]
            return detail if isinstance(detail, str) else detail[0]["msg"]

        assert error({"stream_source": source.replace(coll, "missing")}, 404) == \
            f"collection {db}.missing does not exist"
        pg = f"postgres://127.0.0.1:{stack_config.postgres_port}/streamtune?table=ed_missing_{unique}"
        assert f"table public.ed_missing_{unique} does not exist" in error({"stream_source": pg}, 404)
        assert "not reachable" in error({"stream_source": "postgres://127.0.0.1:1/x?table=t"}, 503)
        assert "unsupported source" in error({"stream_source": "ftp://somewhere"}, 422)
        assert "choose a source" in error({"model_id": "x"}, 422)
        assert preview(pipeline, auth={}).status_code == 401
    finally:
        mongo.drop_database(db)
        mongo.close()
