"""The web console's eval scores and serving panel, and the feedback-only token (marker
`lowcode`).

The API and `streamtune serve` run as processes, as a user starts them; the console is
driven in headless chromium. Versions carrying the promotion gate's decision and scores go
through the registrar (MLflow tags, broadcast) as the job's would: real LoRA adapters of the
tiny base, so the server loads and answers with them. Training is not what is tested here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests

from streamtune.local_job import kill_group, spawn_logged
from streamtune.testing import free_port, random_adapter_files, save_screenshot, wait_for
from test_lowcode import headless_chromium, listening

pytestmark = pytest.mark.lowcode
TOKEN = "console-test-token"
FEEDBACK_TOKEN = "console-feedback-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FEEDBACK_AUTH = {"Authorization": f"Bearer {FEEDBACK_TOKEN}"}


def test_feedback_token_is_accepted_by_feedback_only(tmp_path):
    """In process, no stack call reached: the feedback token passes auth on POST /v1/feedback
    (then 404: no spec for the model) and gets 403 on every other guarded call."""
    from fastapi.testclient import TestClient

    from core.errors import ConfigError
    from streamtune.api import ApiSettings, create_app
    from streamtune.stack.config import StackConfig

    settings = dict(stack=StackConfig.from_env(), token=TOKEN, jobs_file=tmp_path / "jobs.json",
                    promotion_log=tmp_path / "promotions.jsonl", artifact_store=str(tmp_path / "adapters"))
    client = TestClient(create_app(ApiSettings(**settings, feedback_token=FEEDBACK_TOKEN)))
    event = {"type": "click", "model_id": "nobody", "event_id": "e1", "prompt": "p", "completion": "c", "ts": 0}
    for headers in (FEEDBACK_AUTH, AUTH):
        r = client.post("/v1/feedback", json=event, headers=headers)
        assert r.status_code == 404 and "no registered spec" in r.text, r.text
    assert client.post("/v1/feedback", json=event, headers={"Authorization": "Bearer other"}).status_code == 401
    for method, path, body in (("POST", "/v1/models/m/aliases", {"version": 1}), ("POST", "/v1/pipelines", {}),
                               ("DELETE", "/v1/pipelines/p", None), ("POST", "/v1/pipelines/p/pause", None),
                               ("POST", "/v1/stream-finetune", {}), ("DELETE", "/v1/stream-finetune/m", None)):
        r = client.request(method, path, json=body, headers=FEEDBACK_AUTH)
        assert r.status_code == 403 and "POST /v1/feedback only" in r.text, (method, path, r.status_code, r.text)
    reads = TestClient(create_app(ApiSettings(**settings, feedback_token=FEEDBACK_TOKEN)))
    assert reads.get("/v1/pipelines", headers=FEEDBACK_AUTH).status_code == 403
    assert reads.get("/v1/pipelines", headers=AUTH).status_code == 200
    with pytest.raises(ConfigError):
        ApiSettings(**settings, feedback_token=TOKEN)


GATES = [  # v1: first version; v2: better on every set, promoted; v3: forgets, refused
    {"promote": True, "rule": "first_version", "metric": "exact_match", "reason": "first version", "sets": []},
    {"promote": True, "rule": "eval", "metric": "exact_match", "reason": "not worse than the champion on any set",
     "sets": [{"name": "recent", "size": 16, "candidate": {"exact_match": 0.75, "loss": 0.52},
               "champion": {"exact_match": 0.25, "loss": 1.8}, "tolerance": 0.05, "passed": True},
              {"name": "retained", "size": 32, "candidate": {"exact_match": 0.5, "loss": 0.9, "forgotten": 0.0},
               "champion": {"exact_match": 0.125, "loss": 2.1}, "tolerance": 0.1, "passed": True}]},
    {"promote": False, "rule": "eval", "metric": "exact_match",
     "reason": "worse than the champion on retained (forgetting guard): forgot 0.750 of the 16 answers "
               "the champion got right > 0.1",
     "sets": [{"name": "recent", "size": 16, "candidate": {"exact_match": 0.9375, "loss": 0.21},
               "champion": {"exact_match": 0.75, "loss": 0.52}, "tolerance": 0.05, "passed": True},
              {"name": "retained", "size": 32, "candidate": {"exact_match": 0.125, "loss": 1.7, "forgotten": 0.75},
               "champion": {"exact_match": 0.5, "loss": 0.9}, "tolerance": 0.1, "passed": False}]},
]


def register_gated_versions(stack_config, base_model, model_id: str, topic: str, store: Path) -> None:
    """Three version records with gates through the registrar: MLflow versions with the gate's
    tags, aliases as the gate decided, broadcasts on `<topic>.adapter-versions`."""
    from kafka import KafkaProducer

    from connectors.artifact_store import ArtifactStore
    from core.messages import VersionRecord
    from streamtune.registrar import Registrar, RegistrarConfig

    config = RegistrarConfig(bootstrap=stack_config.kafka_bootstrap, tracking_uri=stack_config.mlflow_uri,
                             versions_topic=f"{topic}.test-versions", broadcast_topic=f"{topic}.adapter-versions",
                             group_id=f"test-console-{uuid.uuid4().hex[:8]}", artifact_store=str(store))
    registrar = Registrar(config)
    producer = KafkaProducer(bootstrap_servers=stack_config.kafka_bootstrap, acks="all")
    champion, t0 = None, int(time.time() * 1000) // 2000 * 2000 - 10_000
    for seq, gate in enumerate(GATES, start=1):
        files, sha256 = random_adapter_files(base_model, seq)
        record = VersionRecord.model_validate({
            "version_id": f"{model_id}@{seq}", "model_id": model_id, "seq": seq,
            "window_start": t0 + 2_000 * seq, "window_end": t0 + 2_000 * seq + 1_999,
            "artifact_uri": ArtifactStore(str(store)).put(files, sha256), "sha256": sha256,
            "base_model": str(base_model), "config_version": 1, "fresh_adapter": seq == 1,
            "adapter": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0},
            "trigger_policy": {"min_samples_per_window": 8, "window_seconds": 2},
            "metrics": {"loss_before": 3.0 - seq * 0.5, "loss_after": 2.6 - seq * 0.6, "samples": 8, "tokens": 96,
                        "step_seconds": 0.1},
            "lineage": {"sample_ids": [f"s{seq}"], "offsets": [{"topic": topic, "partition": 0, "first": seq,
                                                               "last": seq}]},
            "trigger": "window", "gate": {**gate, "champion_version_id": champion}})
        if gate["promote"]:
            champion = record.version_id
        producer.send(config.versions_topic, key=model_id.encode(), value=record.to_json().encode()).get(timeout=30)
    producer.close()
    try:
        deadline = time.monotonic() + 90
        while registrar.counts["seen"] < len(GATES):
            assert time.monotonic() < deadline, f"the registrar saw too little: {registrar.counts}"
            registrar.poll_once(500)
        assert registrar.counts["registered"] == len(GATES), registrar.counts
    finally:
        registrar.close()


def test_console_shows_gate_scores_and_the_serving_split_feedback_token_posts_feedback_only(
        stack_config, base_model, unique, tmp_path):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from connectors.kafka import read_topic
    from core.messages import FeedbackSample

    model_id, topic = f"con-{unique}", f"test.con-{unique}"
    store, serve_port = tmp_path / "adapters", free_port()
    serve_url = f"http://127.0.0.1:{serve_port}"
    api_port = free_port()
    api, api_log = f"http://127.0.0.1:{api_port}", tmp_path / "api.log"
    api_proc = spawn_logged([sys.executable, "-m", "streamtune.cli", "api", "--port", str(api_port)], api_log,
                            extra_env={"STREAMTUNE_API_TOKEN": TOKEN, "STREAMTUNE_API_FEEDBACK_TOKEN": FEEDBACK_TOKEN,
                                       "STREAMTUNE_SERVE_URL": serve_url})
    serve_proc, browser, applied = None, None, False
    try:
        wait_for(lambda: listening(api, api_proc, api_log, "/healthz"), 60, "the API to listen", interval=0.3)
        pipeline = {"model_id": model_id, "stream_source": f"kafka://topic={topic}",
                    "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                    # never trains here: the versions come from the records below
                    "trigger_policy": {"min_samples_per_window": 1000, "window_seconds": 3600}}
        r = requests.post(f"{api}/v1/pipelines", json=pipeline, headers=AUTH, timeout=300)
        applied = r.status_code == 201
        assert applied, r.text
        register_gated_versions(stack_config, base_model, model_id, topic, store)
        versions = requests.get(f"{api}/v1/models/{model_id}/versions", timeout=30, headers=AUTH).json()["versions"]
        assert [(v["version"], v["aliases"], v["gate"]["decision"]) for v in versions] == [
            (1, [], "promoted"), (2, ["champion"], "promoted"), (3, ["candidate"], "refused")]
        assert [(s["name"], s["exact_match"], s["champion_exact_match"], s["forgotten"], s["passed"])
                for s in versions[2]["gate"]["sets"]] == [("recent", 0.9375, 0.75, None, True),
                                                          ("retained", 0.125, 0.5, 0.75, False)]

        # No server yet: a clear 503, shown in the serving panel.
        r = requests.get(f"{api}/v1/models/{model_id}/serving", timeout=30, headers=AUTH)
        assert r.status_code == 503 and f"not reachable at {serve_url}" in r.json()["detail"], r.text

        browser = headless_chromium()
        browser.set_window_size(1400, 1500)
        browser.get(f"{api}/console")
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.ID, "refresh").click()
        row = f'#pipelines tr[data-name="{model_id}"]'
        WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.CSS_SELECTOR, row))
        browser.execute_script(f"document.querySelector('{row} td').click()")

        def texts(selector: str) -> list[list[str]]:  # read at once: the console redraws every 5 s
            return browser.execute_script("return [...document.querySelectorAll(arguments[0])]"
                                          ".map(tr => [...tr.cells].map(td => td.innerText))", selector)

        def text(selector: str) -> str:
            return browser.execute_script("const e = document.querySelector(arguments[0]);"
                                          "return e && !e.hidden ? e.innerText : ''", selector)

        WebDriverWait(browser, 30).until(lambda b: len(texts("#versions > tbody > tr")) == 3)
        WebDriverWait(browser, 30).until(lambda b: "not reachable" in text("#serving-error"))
        assert f"streamtune serve not reachable at {serve_url}" in text("#serving-error")
        assert text("#error") == "", "no server is a state shown in its panel, not a failed action"
        gates = [r[6] for r in texts("#versions > tbody > tr")]
        assert gates[0].startswith("promoted") and "first_version" in gates[0]
        assert gates[2].startswith("refused") and "forgot 0.750" in gates[2]
        evals = texts('#versions > tbody > tr:nth-child(3) table.eval tr[data-set]')
        assert evals == [["recent", "16", "0.94 / 0.75", "0.210 / 0.520", "passed (tol 0.05)"],
                         ["retained", "32", "0.13 / 0.50 (forgot 0.75)", "1.700 / 0.900", "failed (tol 0.1)"]]
        # Held-out scores over time: each gated version's own exact match, per set, from its tags.
        points = browser.execute_script("return [...document.querySelectorAll('#heldout-curve circle.heldout-point')]"
                                        ".map(c => c.textContent)")
        assert sorted(points) == sorted(f"v{seq} {s['name']}: exact match {s['candidate']['exact_match']:g}"
                                        for seq, gate in enumerate(GATES, start=1) for s in gate["sets"])
        save_screenshot(browser, tmp_path / "console-gate-no-server.png")

        # The server: half the traffic to the candidate, feedback read from the pipeline's topic.
        serve_log = tmp_path / "serve.log"
        serve_proc = spawn_logged(
            [sys.executable, "-m", "streamtune.cli", "serve", "--port", str(serve_port), "--base-model",
             str(base_model), "--artifact-store", str(store), "--bootstrap-server", stack_config.kafka_bootstrap,
             "--tracking-uri", stack_config.mlflow_uri, "--broadcast-topics", re.escape(f"{topic}.adapter-versions"),
             "--inference-log-topic", f"{topic}.inference-log", "--feedback-topics", re.escape(topic),
             "--candidate-fraction", "0.5", "--promotion-log", str(tmp_path / "promotions.jsonl"),
             "--rollback-min-events", "1000"],
            serve_log, extra_env={"STREAMTUNE_API_TOKEN": TOKEN})

        def routes() -> dict:
            if not listening(serve_url, serve_proc, serve_log, "/readyz"):
                return {}
            data = requests.get(f"{serve_url}/v1/models", timeout=10, headers=AUTH).json()["data"]
            return next((m["aliases"] for m in data if m["id"] == model_id), {})

        wait_for(lambda: routes() == {"champion": 2, "candidate": 3}, 120, "the server to route champion/candidate",
                 interval=0.5)
        answers = []
        for u in range(24):
            r = requests.post(f"{serve_url}/v1/completions", timeout=60, headers=AUTH,
                              json={"model": model_id, "prompt": "x=12;y=", "max_tokens": 3, "user": f"user-{u}"})
            assert r.status_code == 200, r.text
            answers.append(r.json())
        arms = {a["streamtune"]["arm"] for a in answers}
        assert arms == {"champion", "candidate"}, arms

        # The feedback token: feedback citing each response goes in (202) and reaches the topic;
        # the champion's answers are taken, the candidate's corrected.
        events = [{"type": "click", "model_id": model_id, "event_id": f"fb-{i}", "prompt": "x=12;y=",
                   "completion": a["choices"][0]["text"] or "?", "ts": int(time.time() * 1000),
                   "request_id": a["id"]} if a["streamtune"]["arm"] == "champion" else
                  {"type": "correction", "model_id": model_id, "event_id": f"fb-{i}", "prompt": "x=12;y=",
                   "corrected_completion": "23", "ts": int(time.time() * 1000), "request_id": a["id"]}
                  for i, a in enumerate(answers)]
        r = requests.post(f"{api}/v1/feedback", json=events, headers=FEEDBACK_AUTH, timeout=60)
        assert r.status_code == 202 and r.json()["accepted"] == len(events), r.text
        samples = [FeedbackSample.from_json(rec.value) for rec in
                   read_topic(stack_config.kafka_bootstrap, topic, expect=len(events), timeout=30)]
        assert sorted(s.request_id for s in samples) == sorted(a["id"] for a in answers)
        # ... and nothing else: 403 on a state-changing call, which the write token may make.
        r = requests.post(f"{api}/v1/models/{model_id}/aliases", json={"version": 3}, headers=FEEDBACK_AUTH,
                          timeout=30)
        assert r.status_code == 403 and "POST /v1/feedback only" in r.json()["detail"], r.text
        assert requests.get(f"{api}/v1/models/{model_id}/versions", timeout=30,
                            headers=AUTH).json()["versions"][1]["aliases"] == \
            ["champion"]

        by_arm = {arm: sum(a["streamtune"]["arm"] == arm for a in answers) for arm in ("champion", "candidate")}

        def serving() -> dict:
            r = requests.get(f"{api}/v1/models/{model_id}/serving", timeout=30, headers=AUTH)
            assert r.status_code == 200, r.text
            return r.json()

        status = wait_for(lambda: (s := serving()) and all(a.get("judged") == by_arm.get(a["arm"]) for a in s["arms"])
                          and s, 60, "the guard to judge every response")
        assert status["candidate_fraction"] == 0.5 and status["aliases"] == {"champion": 2, "candidate": 3}
        assert [(a["arm"], a["version"], a["requests"], a["errors"], a["responses"], a["accepted"], a["corrected"],
                 a["acceptance"], a["correction_rate"]) for a in status["arms"]] == [
            ("champion", 2, by_arm["champion"], 0, by_arm["champion"], by_arm["champion"], 0, 1.0, 0.0),
            ("candidate", 3, by_arm["candidate"], 0, by_arm["candidate"], 0, by_arm["candidate"], 0.0, 1.0)]
        assert status["guard"]["enabled"] and status["decisions"] == []

        # The console's serving panel shows the same numbers.
        expected = [
            ["champion", "v2", str(by_arm["champion"]), "0", str(by_arm["champion"]), str(by_arm["champion"]),
             str(by_arm["champion"]), "0", "0", "100.0%", "0.0%"],
            ["candidate", "v3", str(by_arm["candidate"]), "0", str(by_arm["candidate"]), str(by_arm["candidate"]),
             "0", str(by_arm["candidate"]), "0", "0.0%", "100.0%"]]
        shown: list = []

        def panel_shows_status() -> bool:  # the panel may still hold a refresh from before the feedback
            shown[:] = [r[:11] for r in texts("#serving-arms tbody tr")]
            return shown == expected

        browser.find_element(By.ID, "refresh").click()
        try:
            WebDriverWait(browser, 30).until(lambda b: panel_shows_status())
        except TimeoutException:
            raise AssertionError(f"the serving panel shows {shown}, the API {expected}") from None
        assert text("#serving-error") == ""
        split = text("#serving-split")
        assert "50.0% to champion v2, 50.0% to candidate v3" in split and serve_url in split, split
        assert "Rollback guard on" in text("#serving-guard")
        assert text("#error") == ""
        browser.execute_script("document.querySelector('#serving').scrollIntoView()")
        save_screenshot(browser, tmp_path / "console-serving.png")
    finally:
        if browser is not None:
            browser.quit()
        if serve_proc is not None:
            kill_group(serve_proc)
        if applied:
            requests.delete(f"{api}/v1/pipelines/{model_id}", headers=AUTH, timeout=300)
        api_proc.terminate()
        try:
            api_proc.wait(timeout=60)
        except Exception:
            kill_group(api_proc)


def test_models_page_lists_a_model_trained_outside_any_pipeline_and_opens_its_versions(
        stack_config, base_model, unique, tmp_path):
    """The registry's models, however trained: one registered by the registrar alone (as a
    `flink run` job's would be) is listed with its aliases and opens its versions."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    model_id, topic = f"solo-{unique}", f"test.solo-{unique}"
    register_gated_versions(stack_config, base_model, model_id, topic, tmp_path / "adapters")
    api_port = free_port()
    api, api_log = f"http://127.0.0.1:{api_port}", tmp_path / "api.log"
    api_proc = spawn_logged([sys.executable, "-m", "streamtune.cli", "api", "--port", str(api_port)], api_log,
                            extra_env={"STREAMTUNE_API_TOKEN": TOKEN})
    browser = None
    try:
        wait_for(lambda: listening(api, api_proc, api_log, "/healthz"), 60, "the API to listen", interval=0.3)
        assert requests.get(f"{api}/v1/models", timeout=30).status_code == 401, "a stranger lists no model"
        listed = {m["model_id"]: m for m in requests.get(f"{api}/v1/models", headers=AUTH, timeout=60).json()["models"]}
        assert listed[model_id]["aliases"] == {"champion": 2, "candidate": 3}
        assert listed[model_id]["latest_version"] == 3 and listed[model_id]["pipeline"] is None
        assert abs(listed[model_id]["latest_created_ms"] - time.time() * 1000) < 600_000
        # The same from the command line, as a user lists them.
        env = {**os.environ, "STREAMTUNE_API_TOKEN": TOKEN}
        cli = [sys.executable, "-m", "streamtune.cli", "get", "models", "--url", api, "-o", "json"]
        out = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert {m["model_id"]: m["aliases"] for m in json.loads(out.stdout)}[model_id] == {"champion": 2,
                                                                                           "candidate": 3}

        browser = headless_chromium()
        browser.set_window_size(1280, 800)
        browser.get(f"{api}/console")
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.ID, "model-filter").send_keys(model_id)
        browser.find_element(By.ID, "refresh").click()
        row = f'#models tr[data-model="{model_id}"]'
        WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.CSS_SELECTOR, row))
        cells = browser.execute_script("return [...document.querySelector(arguments[0]).cells].map(c => c.innerText)",
                                       row)
        assert cells[:4] == [model_id, "v2", "v3", "v3"] and cells[5] == "–", cells
        assert len(browser.find_elements(By.CSS_SELECTOR, "#models tbody tr")) == 1, "the filter narrows the list"
        browser.execute_script(f"document.querySelector('{row} td').click()")
        WebDriverWait(browser, 30).until(
            lambda b: len(b.find_elements(By.CSS_SELECTOR, "#versions > tbody > tr")) == 3)
        assert browser.find_element(By.ID, "model-name").text == model_id
        WebDriverWait(browser, 30).until(lambda b: "Not trained by a pipeline" in b.find_element(By.ID, "no-dlq").text)
        assert browser.find_element(By.ID, "error").text == ""
        save_screenshot(browser, tmp_path / "console-models.png")
    finally:
        if browser is not None:
            browser.quit()
        api_proc.terminate()
        try:
            api_proc.wait(timeout=60)
        except Exception:
            kill_group(api_proc)
