"""bench/gpu.sh on the CPU with the tiny shape: it runs, prints its table and writes its JSON
(the CI check that the GPU benchmark still works; the Llama-3-8B shape needs a GPU)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_bench_tiny_shape_on_cpu(tmp_path):
    out = tmp_path / "gpu-tiny.json"
    proc = subprocess.run(["bash", "bench/gpu.sh", "--shape", "tiny", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for row in ("1. bf16 LoRA steps", "step time p50", "tokens/s", "peak assumed", "MFU",
                "2. fp32 accum 8 vs mixed", "fp32 + 8 accum peak memory", "mixed streaming step",
                "time ratio fp32/mixed", "claim reproduced?", "3. trainer vs bare",
                "ratio trainer/bare (throughput)", "total run time"):
        assert row in proc.stdout, f"table row {row!r} missing:\n{proc.stdout}"
    report = json.loads(out.read_text())
    on_cpu = report["run"]["device"] == "cpu"
    if on_cpu:
        assert "MFU not computed" in proc.stdout  # no dense bf16 peak for a CPU
        assert "not measured on CPU" in proc.stdout

    assert {"run", "goals", "bf16_steps", "precision_comparison", "trainer_vs_bare", "met"} <= set(report)
    run = report["run"]
    assert run["shape"] == "tiny" and run["elapsed_s"] > 0
    assert run["model"]["lora_params"] > 0 and run["flops_per_token"] > 0

    bf16 = report["bf16_steps"]
    if run["bf16_supported"]:
        assert bf16["step_ms"]["p50"] > 0 and bf16["tokens_per_s"] > 0 and bf16["flops_per_step"] > 0
        assert (bf16["mfu"] is None) == (bf16["peak_bf16_tflops"] is None)
    else:
        assert "skipped" in bf16

    comparison = report["precision_comparison"]
    assert comparison["fp32"]["step_ms"]["p50"] > 0
    assert (comparison["fp32"]["peak_gb"] is None) == on_cpu
    if run["bf16_supported"]:
        assert comparison["mixed"]["step_ms"]["p50"] > 0
        assert comparison["time_ratio_fp32_over_mixed"] > 0
    assert comparison["claim"]["fp32_peak_gb"] == 38.2

    trainer = report["trainer_vs_bare"]
    assert trainer["bare"]["window_ms"]["p50"] > 0
    assert trainer["trainer"]["window_ms"]["p50"] > 0
    assert trainer["trainer"]["base_dtype"] == run["model"]["dtype"]
    assert trainer["ratio_trainer_over_bare"] > 0
