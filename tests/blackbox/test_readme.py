"""Issue 14, item 7 (and 35): every example in README.md and in the docs pages runs as written.

An example is the fenced block right after `<!-- example: NAME -->`; the block after
`<!-- output: NAME -->` is what example NAME prints. Each page's examples run in its order,
in one temporary directory of that page's own, against real processes on free ports: the
docs' 7379 (RESP), 7380 (admin API), 8000 (gateway), 8001 and 8002 (engines) are swapped
for free ones in examples and outputs alike, and `myhost` for this machine's name.

- the two fake engines (tests/fake_engine.py) are started from the README tour's command lines
  (the block after `<!-- engines: fake -->`), and a `quilld` node on the quick start's built-in
  defaults is up, before a page's first example;
- ```toml: written to a file named NAME (a later example names it);
- ```sh: run by bash; one whose only command is `quilld ...` replaces the running node by
  one started with those flags (plus `--port`/`--admin-port` when it names none);
- ```python: run by this interpreter, which must exit 0;
- ```console: a `redis-cli` session, `127.0.0.1:7379> COMMAND` lines and their replies:
  each command is run with `redis-cli --no-raw` and must print the reply shown (the handle
  PUT2PHASE BEGIN returns stands for the one shown);
- an output block in JSON must equal the example's output as JSON (a `lease` is random:
  any string stands for the one shown); in any other language, as text.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT, free_port, stop_process, wait_port
from doc_blocks import doc_block, doc_pages

pytestmark = pytest.mark.timeout(240)

README = ROOT / "README.md"
MARKED = re.compile(r"<!-- (example|output): ([\w.-]+) -->\n```(\w*)\n(.*?)```", re.DOTALL)
README_PORTS = ("7379", "7380", "8000", "8001", "8002")
ENGINES = {"8001": "vllm-0", "8002": "vllm-1"}  # the README's engines, by port
ENGINE_MODEL = "meta-llama/Llama-3.1-8B"
RUN_TIMEOUT = 60.0


@dataclass
class Block:
    kind: str  # example | output
    name: str
    lang: str
    body: str


def marked_blocks(page: Path) -> list[Block]:
    text = page.read_text()
    blocks = [Block(*m.groups()) for m in MARKED.finditer(text)]
    # a marker that is not followed by a fenced block would silently drop its example
    assert len(blocks) == len(re.findall(r"<!-- (?:example|output): ", text)), f"{page}: a marker without its block"
    return blocks


def pages_with_examples() -> list[Path]:
    return [p for p in doc_pages() if marked_blocks(p)]


def test_the_docs_mark_their_examples_and_each_output_follows_its_example():
    names = []
    for page in pages_with_examples():
        blocks = marked_blocks(page)
        names += [b.name for b in blocks if b.kind == "example"]
        for i, b in enumerate(blocks):
            assert b.lang in {"sh", "python", "console", "toml", "json", "text"}, (page, b.name, b.lang)
            if b.kind == "output":
                before = blocks[i - 1] if i else None
                assert before and (before.kind, before.name) == ("example", b.name), \
                    f"{page}: output {b.name} does not follow its example"
    assert len(names) == len(set(names)), names
    # the examples the docs are known to carry: losing a marker must not lose a test
    assert {"redis-cli", "redis-py", "engines.toml", "start", "register-engine", "kv-events", "route",
            "gateway", "python-client"} <= set(names), names
    # the README's tour carries the quick look: redis-cli, redis-py, engines, ROUTE, the gateway
    assert {"redis-cli", "redis-py", "engines.toml", "start", "kv-events", "route", "gateway"} <= \
        {b.name for b in marked_blocks(README) if b.kind == "example"}


def fake_engine_commands() -> list[list[str]]:
    """The README tour's command lines for the fake engines, as argv (`&` dropped)."""
    page, body = doc_block("engines: fake")
    assert page == README
    lines = [shlex.split(ln.rstrip().removesuffix("&")) for ln in body.splitlines() if ln.strip()]
    ports = sorted(ln[ln.index("--port") + 1] for ln in lines)
    assert ports == sorted(ENGINES) and all(ln[:2] == ["python", "tests/fake_engine.py"] for ln in lines), lines
    for ln in lines:
        assert ENGINES[ln[ln.index("--port") + 1]] == ln[ln.index("--name") + 1]
        assert ln[ln.index("--model") + 1] == ENGINE_MODEL
    return lines


class Runner:
    def __init__(self, tmp: Path) -> None:
        self.dir = tmp / "work"
        self.dir.mkdir()
        self.ports = {p: str(free_port()) for p in README_PORTS}
        self.procs: list[subprocess.Popen] = []
        self.node: subprocess.Popen | None = None
        self.node_log = tmp / "quilld.log"
        shims = tmp / "bin"
        shims.mkdir()
        shim = shims / "quilld"  # `quilld` as installed by `pip install -e .`, from this checkout
        shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m quilld \"$@\"\n")
        shim.chmod(0o755)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("QUILLD_")}
        self.env.update(PYTHONPATH=str(ROOT), PATH=f"{shims}:{self.env.get('PATH', '')}")
        self.outputs: dict[str, str] = {}

    def sub(self, text: str) -> str:
        text = re.sub(r"\b(" + "|".join(README_PORTS) + r")\b", lambda m: self.ports[m[1]], text)
        return text.replace("myhost", socket.gethostname())

    # -- processes
    def start_engines(self) -> None:
        for argv in fake_engine_commands():
            argv = [sys.executable, *(self.sub(a) for a in argv[1:])]
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=self.env)
            self.procs.append(proc)
            wait_port(int(argv[argv.index("--port") + 1]), proc)

    def start_node(self, argv: list[str]) -> None:
        if self.node is not None:
            assert stop_process(self.node) == 0, self.node_log.read_text()
        if "--port" not in argv:
            argv += ["--port", self.ports["7379"]]
        if "--admin-port" not in argv:
            argv += ["--admin-port", self.ports["7380"]]
        with open(self.node_log, "ab") as log:
            self.node = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir, env=self.env)
        self.procs.append(self.node)
        for flag in ("--port", "--admin-port", "--gateway-port"):
            if flag in argv:
                wait_port(int(argv[argv.index(flag) + 1]), self.node)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            stop_process(proc)

    # -- examples
    def run(self, b: Block) -> str:
        body = self.sub(b.body)
        if b.lang == "toml":
            (self.dir / b.name).write_text(body)
            return ""
        if b.lang == "sh":
            lines = [ln for ln in body.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
            if len(lines) == 1 and lines[0].startswith("quilld "):
                self.start_node(["quilld", *shlex.split(lines[0])[1:]])
                return ""
            return self.process(["bash", "-euo", "pipefail", "-c", body], b)
        if b.lang == "python":
            return self.process([sys.executable, "-c", body], b)
        if b.lang == "console":
            self.redis_cli_session(body, b)
            return ""
        pytest.fail(f"example {b.name}: no way to run a ```{b.lang} block")

    def process(self, argv: list[str], b: Block) -> str:
        r = subprocess.run(argv, cwd=self.dir, env=self.env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        assert r.returncode == 0, f"example {b.name} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def redis_cli_session(self, body: str, b: Block) -> None:
        lines = body.splitlines()
        assert lines[0].startswith("$ redis-cli"), f"example {b.name}: expected `$ redis-cli ...` first"
        base = shlex.split(lines[0][2:])
        prompt = re.compile(r"^[\w.]+:\d+> (.*)$")
        steps: list[tuple[str, list[str]]] = []
        for line in lines[1:]:
            m = prompt.match(line)
            if m:
                steps.append((m[1], []))
            else:
                steps[-1][1].append(line)
        handles: dict[str, str] = {}
        for command, shown in steps:
            for said, real in handles.items():
                command = command.replace(said, real)
            r = subprocess.run([*base, "--no-raw", *shlex.split(command)], capture_output=True, text=True,
                               timeout=RUN_TIMEOUT, env=self.env)
            got, want = r.stdout.rstrip("\n"), "\n".join(shown)
            if command.upper().startswith("PUT2PHASE BEGIN"):  # a new handle each time: the shown one stands for it
                handles[want.strip('"')] = got.strip('"')
                assert re.fullmatch(r'"[0-9a-f]{24}"', got), (command, got)
                continue
            assert got == want, f"example {b.name}: `{command}` printed\n{got}\nnot\n{want}"

    def check_output(self, b: Block, got: str) -> None:
        want = self.sub(b.body)
        if b.lang == "json":
            expected, actual = json.loads(want), json.loads(got)
            if isinstance(expected, dict) and isinstance(expected.get("lease"), str):
                assert isinstance(actual.get("lease"), str) and actual["lease"], actual
                actual["lease"] = expected["lease"]
            assert actual == expected, f"output of {b.name}:\n{got}"
        else:
            assert got.strip() == want.strip(), f"output of {b.name}:\n{got}"


@pytest.mark.parametrize("page", pages_with_examples(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_example_runs_as_written(page, tmp_path):
    blocks = marked_blocks(page)
    runner = Runner(tmp_path)
    try:
        runner.start_engines()
        runner.start_node(["quilld"])  # the quick start: built-in defaults
        ran = []
        for b in blocks:
            if b.kind == "example":
                runner.outputs[b.name] = runner.run(b)
                ran.append(b.name)
            else:
                runner.check_output(b, runner.outputs[b.name])
        assert len(ran) == len([b for b in blocks if b.kind == "example"])
        assert runner.node.poll() is None, runner.node_log.read_text()
        log = runner.node_log.read_text()
        assert "Traceback" not in log and " ERROR " not in log, log
    finally:
        runner.stop_all()
    for proc in runner.procs:
        assert proc.poll() is not None
