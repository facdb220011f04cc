"""One table from bench/results/*.json, PNG plots beside them, and the table of docs/benchmarks.md.

Each benchmark writes its own results file; this reads whichever are there, prints one
table (measure, figure, goal, met), draws the plots (freshness per stage, loss and
throughput of the trainer benchmark) into bench/results/, and rewrites docs/benchmarks.md between
`<!-- bench:begin -->` and `<!-- bench:end -->` with the table, each row dated by its run.
A benchmark not run yet shows as such.

    .venv/bin/python bench/report.py [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def verdict(value: float, goal: float, at_most: bool = True) -> str:
    return "met" if (value <= goal if at_most else value >= goal) else "**not met**"


def rows() -> list[tuple[str, str, str, str, str]]:
    """(benchmark, measure, figure, goal, run)"""
    out = []
    for name, how in (("freshness", "the default (checkpoint on version)"),
                      ("freshness-periodic", "`--no-checkpoint-on-version`")):
        fresh = load(name)
        if not fresh:
            out.append(("freshness", f"window end → committed / registered / broadcast / served, {how}", "not run",
                        "", ""))
            continue
        run = f"{fresh['date']}, {fresh['versions']} versions"
        interval = fresh["checkpoint_ms"] / 1000
        for stage, s in fresh["stages"].items():
            goal = f"p95 ≤ {s['goal_p95_s']:.2f} s: {verdict(s['p95_s'], s['goal_p95_s'])}" if "goal_p95_s" in s else ""
            out.append(("freshness", f"window end → {stage} ({interval:g} s checkpoints; {how})",
                        f"p50 {s['p50_s']:.2f} / p95 {s['p95_s']:.2f} / p99 {s['p99_s']:.2f} s (n={s['n']})", goal, run))
    trainer = load("trainer_overhead")
    if trainer:
        for shape, s in trainer["shapes"].items():
            goal = f"≥ 0.90: {verdict(s['ratio'], 0.9, at_most=False)}" if shape == "30m" else "(fixed per-window cost)"
            out.append(("trainer", f"whole job ÷ bare PEFT loop, `{shape}` ({s['bare_step_ms']:.0f} ms a bare step)",
                        f"{s['ratio']:.3f} ({s['job_samples_per_s']:.1f} vs {s['bare_samples_per_s']:.1f} samples/s)",
                        goal, trainer["date"]))
    else:
        out.append(("trainer", "whole job ÷ bare PEFT loop", "not run", "≥ 0.90", ""))
    cdc = load("cdc_latency")
    if cdc:
        for source, s in cdc["sources"].items():
            out.append(("cdc", f"{source} commit → sample in the job", f"p50 {s['p50_ms']:.0f} / p95 {s['p95_ms']:.0f} ms",
                        f"p50 ≤ {cdc['goal_p50_ms']:.0f} ms: {verdict(s['p50_ms'], cdc['goal_p50_ms'])}", cdc["date"]))
    else:
        out.append(("cdc", "commit → sample in the job", "not run", "", ""))
    serving = load("serving")
    if serving:
        sv, load_ = serving["swap_vs_load"], serving["swaps_under_load"]["latency_ms"]
        date = serving["run"]["at"][:10]
        ratio = sv["peft_load_adapter_ms"]["p50"] / sv["swap_ms"]["p50"]
        p95_ratio = load_["swaps"]["p95"] / load_["no_swaps"]["p95"]
        out += [("serving", "adapter swap p95", f"{sv['swap_ms']['p95']:.2f} ms", f"≤ 1 ms: {verdict(sv['swap_ms']['p95'], 1)}", date),
                ("serving", "PEFT load_adapter ÷ swap (p50)", f"{ratio:.0f}×", f"≥ 10×: {verdict(ratio, 10, at_most=False)}", date),
                ("serving", "request p95 with a swap a second ÷ without", f"{p95_ratio:.2f}",
                 f"≤ 1.10: {verdict(p95_ratio, 1.1)}", date)]
    batching = load("serving_batching")
    if batching:
        c = batching["concurrent"]
        out.append(("serving", f"{batching['clients']} clients ÷ one at a time, throughput ({batching['adapters']} "
                    "adapters, in process)", f"{batching['throughput_ratio']:.2f}× (p95 {c['p95_ms']:.0f} ms)",
                    f"≥ {batching['goal_ratio']:.0f}×: {verdict(batching['throughput_ratio'], batching['goal_ratio'], at_most=False)}",
                    batching.get("date", "")))
    under_load = load("serving_load")
    if under_load:
        date, goal = under_load["date"], under_load["goal"]
        for shape, s in under_load["shapes"].items():
            for c, ratio in s["throughput_ratio"].items():
                r, st = s["concurrent"][c], s["streamed"].get(c)
                first = f", first token p95 {st['ttft_p95_ms']:.0f} ms" if st else ""
                target = (f"≥ {goal['ratio']:g}×: {verdict(ratio, goal['ratio'], at_most=False)}"
                          if shape == goal["shape"] and int(c) == goal["clients"] else "(no goal set)")
                out.append(("serving", f"{c} clients ÷ one at a time over HTTP, throughput, `{shape}` "
                            f"({under_load['adapters']} adapters, `streamtune serve`)",
                            f"{ratio:.2f}× (p95 {r['p95_ms']:.0f} ms{first})", target, date))
        v = under_load["vllm"]
        if "skipped" in v:
            out.append(("serving", "`streamtune serve` ÷ vLLM CPU, throughput", f"skipped: {v['skipped']}", "", date))
        else:
            a, b = v["streamtune"], v["vllm"]
            out.append(("serving", f"`streamtune serve` ÷ vLLM CPU, throughput, `{v['shape']}`, {v['clients']} clients",
                        f"{v['throughput_ratio']:.2f} ({a['requests_per_s']:.1f} vs {b['requests_per_s']:.1f} req/s; "
                        f"p95 {a['p95_ms']:.0f} vs {b['p95_ms']:.0f} ms)", "(no goal set)", date))
    registration = load("registration")
    if registration:
        pub, whole = registration["publish"], registration["whole"]
        out.append(("registration", "what a broadcast waits for ÷ the whole registration, p50 (MLflow requests)",
                    f"{registration['ratio_p50']:.2f} ({pub['p50_ms']:.0f} of {whole['p50_ms']:.0f} ms; "
                    f"{pub['requests']:.0f} of {whole['requests']:.0f} requests)",
                    "(no goal of its own: see freshness)", registration["date"]))
        if "parallel_ratio_p50" in registration:
            one = registration["publish_one_at_a_time"]
            out.append(("registration", "publish_version, independent MLflow requests together ÷ one at a time, p50",
                        f"{registration['parallel_ratio_p50']:.2f} ({pub['p50_ms']:.0f} vs {one['p50_ms']:.0f} ms, "
                        "interleaved)", "(no goal of its own)", registration["date"]))
    many = load("many_models")
    if many:
        last = many["rows"][-1]
        out.append(("many models", f"step time, {last['models']} models ÷ 1 model", f"{last['step_ratio_to_one']:.2f}",
                    "", many["date"]))
    submit_goal = "p50 ≤ 10 s, max ≤ 15 s, ≥ 5 runs"

    def cold_split(submit: dict) -> str:
        cold = submit.get("cold_workers")
        return (f"; interleaved runs with cold Python workers: p50 {cold['p50_s']:.1f} / max {cold['max_s']:.1f} s, "
                f"start {cold['phases_p50_s']['start']:.1f} s; p50 warm ÷ cold {submit['p50_over_cold']:.2f}"
                if cold else "")

    for name in ("submit", "submit-busy", "submit-busy-idle-2s"):
        submit = load(name)
        if not submit:
            if name == "submit":
                out.append(("submit", "`flink run` → first committed version", "not run", submit_goal, ""))
            continue
        met = submit["p50_s"] <= 10 and submit["max_s"] <= 15 and submit["runs"] >= 5
        phases = submit.get("phases_p50_s")
        split = "; p50 " + ", ".join(f"{p} {v:.1f}" for p, v in phases.items()) if phases else ""
        idle = sum(r.get("closed_by_idle_timer", False) for r in submit.get("per_run", []))
        where = "".join([f", {submit['busy_processes']} busy processes beside" if submit.get("busy_processes") else "",
                         f", --idle-timeout-ms {submit['idle_timeout_ms']}" if submit.get("idle_timeout_ms") else ""])
        out.append(("submit", f"`flink run` → first committed version ({submit['checkpoint_ms'] / 1000:g} s checkpoints"
                    f"{where})", f"p50 {submit['p50_s']:.1f} / max {submit['max_s']:.1f} s ({submit['runs']} runs, "
                    f"{idle} closed by the idle timer{split}{cold_split(submit)})",
                    f"{submit_goal}: {'met' if met else 'not met'}", submit["date"]))
    runs = [r for r in (load("ingest"), load("ingest-dense"), load("ingest-1000-models"), load("ingest-floor"),
                        load("ingest-floor-1000-models")) if r]
    for ingest in runs:
        sql = ingest["arms"]["sql"]["records_per_s"]
        density = f", {ingest['records'] // ingest['minutes']:,} records per event-time minute"
        for arm, a in ingest["arms"].items():
            if arm != "sql":
                ratio = ingest["ratio_over_sql"][arm]
                batches = f", {a['micro_batch_ms']} ms micro-batches" if a.get("micro_batch_ms") else ""
                if a.get("floor"):  # bench/ingest_job.py FloorCounts: a ceiling, no goal of its own
                    what = ("the least keyed Python function (one state read and write per row, one timer per "
                            f"window; {a['bundle_ms']} ms bundles")
                    goal = "none: the most any windowing in Python reaches behind this front"
                else:
                    what = f"windowing ({a['bundle_ms']} ms Python bundles"
                    goal = f"≥ {ingest['goal_ratio']:g}: {verdict(ratio, ingest['goal_ratio'], at_most=False)}"
                out.append(("ingest", f"records/s through the job's validation and {what}{batches}, "
                            f"{ingest['models']} models{density}) ÷ the same counts in Flink SQL",
                            f"{ratio:.4f} ({a['records_per_s']:.0f} vs {sql:.0f} records/s)", goal, ingest["date"]))
    if not runs:
        out.append(("ingest", "records/s through validation and windowing ÷ the same aggregation in Flink SQL",
                    "not run", "", ""))
    return out


def table(lines: list[tuple]) -> str:
    head = "| benchmark | measure | figure | goal | run |\n|---|---|---|---|---|\n"
    return head + "".join(f"| {' | '.join(r)} |\n" for r in lines)


def plots() -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fresh = load("freshness")
    if fresh and all("values_s" in s for s in fresh["stages"].values()):
        fig, ax = plt.subplots(figsize=(7, 4))
        for stage, s in fresh["stages"].items():
            values = s["values_s"]
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=f"{stage} (n={len(values)})")
        periodic = load("freshness-periodic")
        for stage in ("committed", "broadcast") if periodic else ():
            values = periodic["stages"][stage]["values_s"]
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], linestyle="--",
                    label=f"{stage}, periodic checkpoints only (n={len(values)})")
        ax.axvline(fresh["checkpoint_ms"] / 1000, color="grey", linestyle=":", label="checkpoint interval")
        ax.set(xlabel="seconds after the window's end", ylabel="fraction of versions",
               title=f"Freshness per stage, checkpoint on each version ({fresh['date']})")
        ax.legend()
        written.append(_save(fig, "freshness.png"))
    trainer = load("trainer_overhead")
    if trainer and all("versions" in s for s in trainer["shapes"].values()):
        fig, (loss, rate) = plt.subplots(1, 2, figsize=(11, 4))
        for shape, s in trainer["shapes"].items():
            v = s["versions"]
            loss.plot([x["loss_before"] for x in v], label=f"{shape}: loss before")
            loss.plot([x["loss_after"] for x in v], label=f"{shape}: loss after")
            # Versions come out in bursts (bench/trainer_overhead.py): samples done over time,
            # the bare loop's rate beside it, rather than a rate per version.
            backlog = v[1:]  # the first version started the job, before the clock
            done = [sum(x["samples"] for x in backlog[:i + 1]) for i in range(len(backlog))]
            line, = rate.step([0] + [x["t_s"] for x in backlog], [0] + done, where="post", label=f"{shape}: job")
            end = backlog[-1]["t_s"] if backlog else 0
            rate.plot([0, end], [0, s["bare_samples_per_s"] * end], linestyle=":", color=line.get_color(),
                      label=f"{shape}: bare loop's rate")
        loss.set(xlabel="version", ylabel="loss", title="Loss per version")
        rate.set(xlabel="seconds after the backlog was sent", ylabel="samples in versions",
                 title="Job progress over time")
        loss.legend()
        rate.legend()
        written.append(_save(fig, "trainer.png"))
    return written


def _save(fig, name: str) -> Path:
    path = RESULTS / name
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


BENCHMARKS_PAGE = REPO / "docs" / "benchmarks.md"


def write_benchmarks_page(text: str) -> None:
    page = BENCHMARKS_PAGE
    body = page.read_text()
    if BEGIN not in body:
        sys.exit(f"docs/benchmarks.md has no {BEGIN} … {END} section")
    block = f"{BEGIN}\n{text}{END}"
    page.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, body, flags=re.S))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-docs", action="store_true", help="leave docs/benchmarks.md as it is")
    args = parser.parse_args()
    text = table(rows())
    print(text)
    for path in plots():
        print(f"plot: {path.relative_to(REPO)}")
    if not args.no_docs:
        write_benchmarks_page(text)
        print("docs/benchmarks.md: benchmark table rewritten")


if __name__ == "__main__":
    main()
