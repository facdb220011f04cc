"""A registered version is an MLflow pyfunc model: loaded and served by MLflow's own tools,
from a separate process that knows nothing but MLFLOW_TRACKING_URI."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests

from connectors.artifact_store import ArtifactStore, artifact_sha256, with_manifest
from connectors.mlflow_registry import make_client, register_version
from core.messages import VersionRecord
from streamtune.tinymodel import digit_completion, digit_pairs, digit_prompt

pytestmark = pytest.mark.docs

DIGITS = ("1234", "5678", "9012", "3456")
PROMPTS = [digit_prompt(d) for d in DIGITS] + ["x=1;y="]
VENV_BIN = Path(sys.executable).parent


def _train_adapter(base_model: Path, out: Path) -> list[str]:
    """A LoRA adapter trained on the digit task (a few seconds on CPU); its greedy completions
    of PROMPTS, computed here without MLflow."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.batching import collate, encode_example

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(base_model)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_model), LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    train = digit_pairs(32 * 150, seed=0, exclude=set(DIGITS))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for i in range(0, len(train), 32):
        batch = collate([encode_example(tok, p, c, 32) for p, c in train[i:i + 32]], tok.pad_token_id)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    model.save_pretrained(out)
    pad, eos = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id, tok.eos_token_id
    completions = []
    with torch.no_grad():
        for prompt in PROMPTS:  # one at a time: no padding to agree on
            ids = torch.tensor([tok(prompt)["input_ids"]])
            row = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                 do_sample=False, eos_token_id=eos, pad_token_id=pad)[0, ids.shape[1]:].tolist()
            row = row[:row.index(eos)] if eos in row else row
            completions.append(tok.decode(row, skip_special_tokens=True).strip())
    return completions


def _record(model_id: str, base_model: Path, store: ArtifactStore, adapter_dir: Path) -> VersionRecord:
    files = with_manifest({name: (adapter_dir / name).read_bytes()
                           for name in ("adapter_config.json", "adapter_model.safetensors")})
    sha256 = artifact_sha256(files)
    return VersionRecord.model_validate({
        "version_id": f"{model_id}@1#0:0-0:9", "model_id": model_id, "seq": 1, "window_start": 0, "window_end": 1000,
        "artifact_uri": store.put(files, sha256), "sha256": sha256, "base_model": str(base_model),
        "config_version": 1, "fresh_adapter": True,
        "adapter": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
        "trigger_policy": {"min_samples_per_window": 10, "window_seconds": 1},
        "metrics": {"loss_before": 2.0, "loss_after": 0.1, "samples": 10, "tokens": 80, "step_seconds": 0.1},
        "lineage": {"sample_ids": ["s0"], "offsets": [{"topic": "t", "partition": 0, "first": 0, "last": 9}]},
        "trigger": "window"})


@pytest.fixture(scope="module")
def champion(stack_config, base_model, tmp_path_factory):
    """One registered version of a fresh model, `champion`, and what it should answer."""
    tmp = tmp_path_factory.mktemp("flavor")
    model_id = f"flavor-{uuid.uuid4().hex[:10]}"
    expected = _train_adapter(Path(base_model), tmp / "adapter")
    assert sum(c == digit_completion(d) for c, d in zip(expected, DIGITS)) >= 3, \
        f"the adapter did not learn the task: {expected}"
    client = make_client(stack_config.mlflow_uri)
    mv, created = register_version(client, _record(model_id, Path(base_model), ArtifactStore(str(tmp / "store")),
                                                   tmp / "adapter"), ArtifactStore(str(tmp / "store")))
    assert created and client.get_registered_model(model_id).aliases["champion"] == mv.version
    return {"model_id": model_id, "mv": mv, "expected": expected, "client": client}


def _clean_env(stack_config) -> dict[str, str]:
    """What a user's shell has: PATH and HOME, and the tracking server. Nothing of streamtune."""
    return {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
            "MLFLOW_TRACKING_URI": stack_config.mlflow_uri}


def test_version_source_is_a_pyfunc_model_beside_the_adapter(champion):
    client, mv = champion["client"], champion["mv"]
    assert mv.source == f"runs:/{mv.run_id}/model"
    assert {f.path for f in client.list_artifacts(mv.run_id, "adapter")} == {
        "adapter/adapter_config.json", "adapter/adapter_model.safetensors", "adapter/manifest.json"}
    model_files = {f.path for f in client.list_artifacts(mv.run_id, "model")}
    assert {"model/MLmodel", "model/requirements.txt", "model/pyfunc_model.py"} <= model_files
    requirements = Path(client.download_artifacts(mv.run_id, "model/requirements.txt")).read_text()
    assert all(f"{p}==" in requirements for p in ("mlflow", "torch", "transformers", "peft")), requirements


def test_pyfunc_load_from_a_separate_process(stack_config, champion, tmp_path):
    script = ("import json, mlflow, sys\n"
              f"model = mlflow.pyfunc.load_model('models:/{champion['model_id']}@champion')\n"
              f"print('PREDICTIONS=' + json.dumps(list(model.predict({PROMPTS!r}))))\n")
    done = subprocess.run([str(VENV_BIN / "python"), "-c", script], cwd=tmp_path, env=_clean_env(stack_config),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("PREDICTIONS=")][-1]
    assert json.loads(line.removeprefix("PREDICTIONS=")) == champion["expected"]


def test_pyfunc_refuses_an_altered_adapter(champion, tmp_path):
    import mlflow

    mv = champion["mv"]
    local = Path(champion["client"].download_artifacts(mv.run_id, "model", str(tmp_path)))
    weights = local / "artifacts" / "adapter" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(Exception, match="sha256 mismatch for adapter_model.safetensors"):
        mlflow.pyfunc.load_model(str(local))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mlflow_models_serve_answers_invocations(stack_config, champion, tmp_path):
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([str(VENV_BIN / "mlflow"), "models", "serve", "-m",
                               f"models:/{champion['model_id']}@champion", "--env-manager", "local",
                               "-p", str(port), "--host", "127.0.0.1"],
                              cwd=tmp_path, env=_clean_env(stack_config), stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow models serve did not come up in 240 s"
            try:
                if requests.get(f"http://127.0.0.1:{port}/ping", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        answer = requests.post(f"http://127.0.0.1:{port}/invocations", json={"inputs": PROMPTS}, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["predictions"] == champion["expected"]
        # The DataFrame shape too: one prompt per row.
        answer = requests.post(f"http://127.0.0.1:{port}/invocations", timeout=120,
                               json={"dataframe_split": {"columns": ["prompt"], "data": [[p] for p in PROMPTS[:2]]}})
        assert answer.status_code == 200, answer.text
        assert answer.json()["predictions"] == champion["expected"][:2]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
