"""The documentation (marker `docs`): the MkDocs site builds with --strict, tracked files refer to
nothing outside the repository, and the runnable blocks of README.md and docs/getting-started.md
run against the local stack.

A block is runnable when the line before its fence is `<!-- runnable -->`: ```sh blocks run in
one bash session per file (so exports and background servers carry over), ```python blocks in
the venv's Python. The session runs in a scratch directory, in a process group of its own that
is killed afterwards, so servers a block starts in the background stop with it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.docs

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

# References to things outside the repository: trackers, work logs, private paths. Each pattern
# names what it catches; the planted samples below prove each one can fail.
OUTSIDE_REFERENCES = {
    "ticket or issue number": re.compile(r"\b(?:issue|ticket)s?\s*#?\d+\b|\bticket\b", re.I),
    "the seed (an outside starting point)": re.compile(r"\bthe seed\b(?! (?:of|for|from|value|is|=))", re.I),
    "work log or session notes": re.compile(r"\bwork[ -]?log\b|\bsession notes?\b|\bwork session\b", re.I),
    "a path outside the repository": re.compile(r"\.\./shared\b|/work/|\bFACTS(?:\.md)?\b"),
}
PLANTED = ["see issue 15", "as in ticket #3", "the ticket says", "from the seed repository", "my work log",
           "session notes", "../shared/x", "/work/main/x", "FACTS.md", "(FACTS)"]
INNOCENT = ["the seed of each step", "seed: 0", "issues a checkpoint", "workers", "frameworks/", "a fact"]
# The test itself names the patterns.
ALLOWED_FILES = {"tests/test_docs.py"}


def outside_references(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, rx in OUTSIDE_REFERENCES.items() for m in rx.finditer(text)]


def test_the_matcher_catches_planted_references_and_passes_ordinary_words():
    for sample in PLANTED:
        assert outside_references(sample), f"not caught: {sample!r}"
    for sample in INNOCENT:
        assert not outside_references(sample), f"caught, but ordinary: {sample!r}"


def test_tracked_files_refer_to_nothing_outside_the_repository():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    found = []
    for name in (f.decode() for f in files if f):
        path = REPO / name
        if name in ALLOWED_FILES or not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary: images, weights
        for n, line in enumerate(text.splitlines(), 1):
            found += [f"{name}:{n}: {hit}" for hit in outside_references(line)]
    assert not found, "references to things outside the repository:\n" + "\n".join(found)


def test_site_builds_strictly(tmp_path):
    """Broken links, pages missing from the nav and generator failures are errors in strict mode."""
    r = subprocess.run([str(VENV_BIN / "mkdocs"), "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    for page in ("index.html", "getting-started/index.html", "reference/messages/index.html",
                 "reference/rest-api/index.html", "reference/cli/index.html", "reference/metrics/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    cli = (tmp_path / "site" / "reference/cli/index.html").read_text()
    assert "streamtune apply" in cli and "--dry-run" in cli, "the CLI reference comes from the parsers"
    assert "FeedbackSample" in (tmp_path / "site" / "reference/messages/index.html").read_text()
    assert "/v1/pipelines" in (tmp_path / "site" / "reference/rest-api/index.html").read_text()
    assert "windows_fired" in (tmp_path / "site" / "reference/metrics/index.html").read_text()


RUNNABLE = re.compile(r"^<!-- runnable -->\n```(sh|python)\n(.*?)^```$", re.M | re.S)


def runnable_script(markdown: str) -> str:
    """The file's runnable blocks as one bash script, in order."""
    parts = ["set -euo pipefail"]
    for n, (lang, body) in enumerate(RUNNABLE.findall(markdown)):
        if lang == "sh":
            parts.append(body)
        else:
            parts.append(f"python - <<'RUNNABLE_PY_{n}'\n{body}RUNNABLE_PY_{n}")
    return "\n".join(parts) + "\n"


def test_runnable_blocks_are_found():
    sample = "x\n<!-- runnable -->\n```sh\necho a\n```\n\n```sh\necho skipped\n```\n<!-- runnable -->\n```python\nprint(1)\n```\n"
    script = runnable_script(sample)
    assert "echo a" in script and "print(1)" in script and "skipped" not in script


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_port_free(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _port_in_use(port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.parametrize("doc", ["README.md", "docs/getting-started.md"])
def test_runnable_blocks_run_against_the_local_stack(doc, tmp_path):
    markdown = (REPO / doc).read_text()
    script = runnable_script(markdown)
    assert len(RUNNABLE.findall(markdown)) >= 3, f"{doc} lost its runnable blocks"
    if "--port 8000" in script:  # the blocks start `streamtune api` there, as a reader would
        assert _wait_port_free(8000, 30), "port 8000 is taken by another process"
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    for name in ("STREAMTUNE_API_TOKEN", "STREAMTUNE_API_URL"):
        env.pop(name, None)
    proc = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{doc}: runnable blocks still running after 90 s:\n{out[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # servers the blocks left in the background
        except ProcessLookupError:
            pass
        if not _wait_port_free(8000, 20):  # the API stops within its shutdown grace, or is killed
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_port_free(8000, 10)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in tmp_path.glob("*.log"))
    assert proc.returncode == 0, f"{doc}: runnable blocks failed:\n{out[-4000:]}{logs}"
    assert '"dry_run": true' in out, out[-2000:]
