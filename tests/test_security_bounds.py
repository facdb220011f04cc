"""Bounded inputs (marker `security`): a spec cannot make a worker read without bound.

- `eval_uri` naming a device (/dev/zero) or a kernel file is refused by the spec's own
  validation, so the API answers 422 and no job ever sees it.
- A path outside the eval roots (STREAMTUNE_EVAL_ROOTS, the artifact store) is refused by the
  reader; in the trainer that is a gate failure with the reason, the version not promoted.
- A file over the cap (STREAMTUNE_EVAL_MAX_BYTES) stops being read at the cap: a 64 GiB sparse
  file fails in well under a second with bounded memory. A failure is cached: a replay does
  not read the file again.
- Every size in a spec has a cap (core/messages/spec.py's table), and the API refuses a spec
  over one.

Shown to fail with the defence off: STREAMTUNE_EVAL_UNBOUNDED=1 (tests and demos only) makes
the reader take a file outside the roots and one over the cap, as before.
"""

from __future__ import annotations

import json
import os
import re
import tracemalloc
import time
import typing

import pytest
from fastapi.testclient import TestClient

from core.messages import spec as spec_module
from core.messages import EvaluationConfig, FinetuneSpec
from operators.quality import load_fixed

pytestmark = [pytest.mark.security]


def jsonl(path, lines: int) -> None:
    path.write_text("".join(json.dumps({"prompt": f"x={i};y=", "completion": str(i + 1)}) + "\n"
                            for i in range(lines)))


@pytest.fixture
def roots(tmp_path, monkeypatch):
    """An eval root and, beside it, a directory outside every root."""
    inside, outside = tmp_path / "eval-root", tmp_path / "elsewhere"
    inside.mkdir(), outside.mkdir()
    monkeypatch.setenv("STREAMTUNE_EVAL_ROOTS", str(inside))
    monkeypatch.delenv("STREAMTUNE_EVAL_MAX_BYTES", raising=False)
    monkeypatch.delenv("STREAMTUNE_EVAL_UNBOUNDED", raising=False)
    return inside, outside


@pytest.mark.parametrize("uri", ["/dev/zero", "file:///dev/urandom", "/proc/self/mem", "/sys/kernel/notes",
                                 "/data/../dev/zero"])
def test_a_device_or_kernel_file_as_eval_uri_is_refused_by_the_spec(uri):
    with pytest.raises(ValueError, match=r"eval_uri must be"):
        EvaluationConfig.from_dict({"eval_uri": uri})


@pytest.mark.parametrize("defence", ["on", "defence-off"])
def test_an_eval_file_outside_the_roots_is_refused(roots, monkeypatch, defence):
    inside, outside = roots
    jsonl(inside / "ok.jsonl", 5)
    jsonl(outside / "private.jsonl", 7)  # someone else's file the spec's author wants scored (and logged)
    assert len(load_fixed(f"file://{inside / 'ok.jsonl'}", 100)) == 5
    link = inside / "link.jsonl"
    link.symlink_to(outside / "private.jsonl")  # a link inside a root does not lead out of it
    if defence == "defence-off":
        monkeypatch.setenv("STREAMTUNE_EVAL_UNBOUNDED", "1")
        assert len(load_fixed(str(outside / "private.jsonl"), 100)) == 7, "off: read as before"
        assert len(load_fixed(str(link), 100)) == 7
        return
    for path in (outside / "private.jsonl", link):
        with pytest.raises(ValueError, match="outside the eval roots"):
            load_fixed(str(path), 100)


@pytest.mark.parametrize("defence", ["on", "defence-off"])
def test_an_oversize_eval_file_is_cut_at_the_cap_and_the_failure_is_not_repeated(roots, monkeypatch, defence):
    inside, _ = roots
    monkeypatch.setenv("STREAMTUNE_EVAL_MAX_BYTES", str(1 << 20))
    big = inside / "big.jsonl"
    jsonl(big, 40_000)  # ~1.5 MiB
    assert big.stat().st_size > 1 << 20
    if defence == "defence-off":
        monkeypatch.setenv("STREAMTUNE_EVAL_UNBOUNDED", "1")
        assert len(load_fixed(str(big), 10)) == 10, "off: the whole file is read"
        return
    with pytest.raises(ValueError, match=r"over the eval file cap of 1048576 bytes") as first:
        load_fixed(str(big), 10)
    with pytest.raises(ValueError) as again:
        load_fixed(str(big), 10)
    assert again.value is first.value, "a replay gets the cached refusal: the file is not read again"

    sparse = inside / "sparse.jsonl"  # 64 GiB that a whole read would try to hold in memory
    with open(sparse, "wb") as f:
        f.truncate(64 << 30)
    tracemalloc.start()
    started = time.monotonic()
    with pytest.raises(ValueError, match="over the eval file cap"):
        load_fixed(str(sparse), 10)
    elapsed, (_, peak) = time.monotonic() - started, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 5 and peak < 8 << 20, (elapsed, peak)


def test_the_trainer_gate_refuses_an_eval_file_outside_the_roots(base_model, roots, tmp_path):
    """Through the job's own FinetuneFunction: the version is recorded, not promoted, with the reason."""
    from test_trainer_quality import WINDOW, fire_windows, pendings, quality_spec
    from streamtune.conflicting_tasks import task_a
    from streamtune.testing import trainer_function

    _, outside = roots
    jsonl(outside / "private.jsonl", 20)
    fn = trainer_function(str(base_model), tmp_path / "store")
    spec = quality_spec("bounded", evaluation={"eval_uri": f"file://{outside / 'private.jsonl'}", "metric": "loss"})
    first, second = fire_windows(fn, spec, pendings(task_a(2 * WINDOW, seed=3), "a", 0))
    assert not second.gate.promote and "outside the eval roots" in second.gate.reason, second.gate


def capped_fields() -> dict[str, tuple]:
    """Every numeric field of the spec's sections: (lower, upper) bounds from its Field."""
    out = {}
    for section, model in [("", FinetuneSpec), *[(name, model) for name, model in spec_module.__dict__.items()
                                                  if isinstance(model, type) and name.endswith(("Config", "Policy"))]]:
        for name, field in model.model_fields.items():
            annotation = typing.get_args(field.annotation) or (field.annotation,)
            if int in annotation and bool not in annotation:
                upper = [m.le for m in field.metadata if getattr(m, "le", None) is not None]
                out[f"{model.__name__}.{name}"] = upper[0] if upper else None
    return out


def test_every_integer_size_in_a_spec_has_a_cap_listed_in_the_table():
    uncapped = [name for name, upper in capped_fields().items() if upper is None]
    assert not uncapped, f"sizes without a cap: {uncapped}"
    table = spec_module.__doc__
    for name in capped_fields():
        field = name.split(".", 1)[1]
        assert field in table or name.startswith("FinetuneSpec.seed"), f"{name} is not in the caps table"
    docs = (os.path.dirname(spec_module.__file__) + "/../../docs/security.md")
    assert re.search(r"max_samples_per_step", open(docs).read()), "docs/security.md lists the caps"


def test_the_api_refuses_a_spec_over_a_cap(stack_config, tmp_path):
    from streamtune.api.app import ApiSettings, create_app

    app = create_app(ApiSettings(stack=stack_config, token="bounds-admin", jobs_file=tmp_path / "jobs.json",
                                 promotion_log=tmp_path / "promotions.jsonl"))
    spec = {"model_id": "bounded", "stream_source": "kafka://topic=bounded",
            "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]},
            "trigger_policy": {"min_samples_per_window": 1, "window_seconds": 1, "max_samples_per_step": 10 ** 9}}
    with TestClient(app) as client:
        r = client.post("/v1/pipelines?dry_run=true", json=spec, headers={"Authorization": "Bearer bounds-admin"})
        assert r.status_code == 422 and "max_samples_per_step" in r.text, r.text
        spec["trigger_policy"]["max_samples_per_step"] = 10
        spec["evaluation"] = {"eval_uri": "/dev/zero"}
        r = client.post("/v1/pipelines?dry_run=true", json=spec, headers={"Authorization": "Bearer bounds-admin"})
        assert r.status_code == 422 and "not under /dev" in r.text, r.text
