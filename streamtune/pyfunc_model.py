"""The MLflow pyfunc flavor of a registered adapter version: base model + LoRA adapter -> completions.

Each registered version's run holds this model at `model/` (the version's source,
`runs:/<run>/model`), so MLflow's own tools load it:

    mlflow.pyfunc.load_model("models:/<model_id>@champion").predict(["x=1;y="])
    mlflow models serve -m models:/<model_id>@champion --env-manager local -p 5001

The model directory holds the adapter files (artifact `adapter`: the PEFT files and their
manifest.json, checked on load like every reader checks them), and names the base model in
its model config (`base_model`): a directory or a Hugging Face id. The base is referenced,
not copied: it is the same for every version of a model, and a copy per version would
multiply its size by the versions kept. The loading process must therefore reach it at that
path (a shared volume), or name where it is with STREAMTUNE_PYFUNC_BASE_MODEL.

This file is logged as "model from code": MLflow copies it into the model directory and runs
it from there, so loading needs mlflow, torch, transformers and peft, not streamtune itself.
It imports nothing from this project for that reason.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlflow
from mlflow.pyfunc import PythonModel

BASE_MODEL_ENV = "STREAMTUNE_PYFUNC_BASE_MODEL"  # where the base model is, when not at its recorded path
MANIFEST = "manifest.json"


def _check_manifest(adapter_dir: Path) -> None:
    """The adapter directory is the one registered: every file its manifest lists, with its
    sha256, and no other file (the artifact store's rule, connectors/artifact_store.py)."""
    manifest_path = adapter_dir / MANIFEST
    if not manifest_path.exists():
        return  # artifacts written under the weights-only address rule carry no manifest
    listed = json.loads(manifest_path.read_bytes())["files"]
    present = {p.name for p in adapter_dir.iterdir() if p.is_file()} - {MANIFEST}
    if present != set(listed):
        raise ValueError(f"adapter {adapter_dir}: files {sorted(present)} do not match its manifest {sorted(listed)}")
    for name, digest in listed.items():
        actual = hashlib.sha256((adapter_dir / name).read_bytes()).hexdigest()
        if actual != digest:
            raise ValueError(f"adapter {adapter_dir}: sha256 mismatch for {name}")


def _prompts(model_input) -> list[str]:
    """A list of prompts from what pyfunc hands over: a list, a string, an array or a
    DataFrame (its first column: what `mlflow models serve` builds from `dataframe_split`)."""
    if isinstance(model_input, str):
        return [model_input]
    if hasattr(model_input, "columns"):
        column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
        return [str(v) for v in model_input[column].tolist()]
    if hasattr(model_input, "tolist"):
        model_input = model_input.tolist()
    if isinstance(model_input, dict):
        model_input = model_input.get("prompt", next(iter(model_input.values()), []))
        model_input = [model_input] if isinstance(model_input, str) else model_input
    return [str(v) for v in model_input]


class AdapterCompletionModel(PythonModel):
    """Greedy completions of the base model with the version's LoRA adapter applied.

    Model config: `base_model` (path or Hugging Face id), `max_new_tokens` (default 16);
    `params={"max_new_tokens": n}` overrides it per call.
    """

    def load_context(self, context):
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        config = context.model_config or {}
        adapter_dir = Path(context.artifacts["adapter"])
        _check_manifest(adapter_dir)
        base = os.environ.get(BASE_MODEL_ENV) or config.get("base_model")
        if not base:
            raise ValueError(f"no base model: the model config names none; set {BASE_MODEL_ENV}")
        if base.startswith("/") and not Path(base).exists():
            raise FileNotFoundError(f"base model {base} not found here: mount it at that path or set {BASE_MODEL_ENV}")
        self.max_new_tokens = int(config.get("max_new_tokens", 16))
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "left"  # generation continues every prompt from its end
        model = AutoModelForCausalLM.from_pretrained(base)
        self.model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
        self._torch = torch

    def predict(self, context, model_input, params=None):
        prompts = _prompts(model_input)
        if not prompts:
            return []
        max_new_tokens = int((params or {}).get("max_new_tokens", self.max_new_tokens))
        batch = self.tokenizer(prompts, return_tensors="pt", padding=True)
        with self._torch.no_grad():
            out = self.model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id,
                                      eos_token_id=self.tokenizer.eos_token_id)
        width, eos = batch["input_ids"].shape[1], self.tokenizer.eos_token_id
        completions = []
        for row in out[:, width:].tolist():
            if eos in row:
                row = row[:row.index(eos)]
            completions.append(self.tokenizer.decode(row, skip_special_tokens=True).strip())
        return completions


mlflow.models.set_model(AdapterCompletionModel())
