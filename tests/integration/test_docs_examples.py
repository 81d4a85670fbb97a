"""The API docs' examples, run as written against the session's real mesh (issue 34).

Every ```bash / ```sh block that calls `curl` and every ```python block of docs/apis.md (and
docs/lora.md), and those
of README.md's "OpenAI API" section, is extracted and run: curl blocks through `bash` (each `curl`
given `-sS --fail-with-body --max-time 120`, the script `-e -o pipefail`), Python blocks with
`exec` in a fresh namespace. The docs are written for `make run` (`localhost:8000` or
`127.0.0.1:8000`); the tests put the gateway's address in its place. A block preceded by an HTML
comment `<!-- not run: why -->` is skipped, and reported as skipped with that reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# (file, the `## ` section whose examples run; None: every section)
SOURCES = [("docs/apis.md", None), ("docs/lora.md", None), ("README.md", "OpenAI API")]
DOCS_ADDRESS = re.compile(r"\b(?:localhost|127\.0\.0\.1):8000\b")
FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->", re.S)
CURL_FLAGS = "-sS --fail-with-body --max-time 120"


@dataclasses.dataclass
class Example:
    source: str
    heading: str
    index: int  # 1-based, within its heading
    lang: str  # "bash" or "python"
    code: str
    skip: str | None  # the reason, for a block marked `<!-- not run: ... -->`

    @property
    def id(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", self.heading).strip("-").lower()
        return f"{pathlib.Path(self.source).stem}:{slug}:{self.index}"


def extract(source: str, only_section: str | None) -> list[Example]:
    lines = (ROOT / source).read_text().splitlines()
    examples: list[Example] = []
    heading, counts, i = "", {}, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            heading = line.lstrip("#").strip()
        m = FENCE.match(line)
        if not m:
            i += 1
            continue
        lang, start = m.group(1).lower(), i + 1
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        code = "\n".join(lines[start:i]) + "\n"
        i += 1
        runnable = lang == "python" or (lang in ("bash", "sh", "shell") and re.search(r"\bcurl\b", code))
        if not runnable or (only_section is not None and heading != only_section):
            continue
        # an HTML comment right before the block (blank lines allowed)
        before = "\n".join(lines[max(0, start - 4) : start - 1]).rstrip()
        marks = NOT_RUN.findall(before.split("```")[-1])
        counts[heading] = counts.get(heading, 0) + 1
        examples.append(
            Example(
                source,
                heading,
                counts[heading],
                "python" if lang == "python" else "bash",
                code,
                marks[-1] if marks else None,
            )
        )
    return examples


EXAMPLES = [e for source, section in SOURCES for e in extract(source, section)]


def test_the_docs_have_examples():
    langs = {(e.source, e.lang) for e in EXAMPLES}
    assert ("docs/apis.md", "bash") in langs and ("docs/apis.md", "python") in langs, langs
    assert ("README.md", "python") in langs, langs
    assert len({e.id for e in EXAMPLES}) == len(EXAMPLES)
    skipped = [f"{e.id} ({e.skip})" for e in EXAMPLES if e.skip]
    assert len(skipped) <= 3, f"keep the not-run list short: {skipped}"


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_docs_example(example: Example, gateway_mesh):
    if example.skip:
        pytest.skip(f"not run: {example.skip}")
    address = gateway_mesh.gateway.address  # host:port
    code = DOCS_ADDRESS.sub(address, example.code)
    assert address in code, "the example names no `localhost:8000` to point at the gateway"
    env = {k: v for k, v in os.environ.items() if k != "LLMESH_API_KEY"}  # the docs' `make run`: no key
    if example.lang == "bash":
        script = re.sub(r"\bcurl\b", f"curl {CURL_FLAGS}", code)
        proc = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=ROOT,
        )
        report = f"--- script ---\n{script}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        assert proc.returncode == 0, f"exit {proc.returncode}\n{report}"
        out = proc.stdout
    else:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code, example.id, "exec"), {"__name__": "__docs_example__"})
        out = buf.getvalue()
    assert out.strip(), f"the example printed nothing:\n{code}"
