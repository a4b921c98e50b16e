"""Every command and Python example in README.md and the pages it links under docs/ runs: the
Python blocks in fresh interpreters, the shell commands through bash from the repo root. `make
test` is what CI runs (`.ci/run`); `make bench` runs here with `--quick` (the full suite takes
minutes). `make demo` (about 2.5 minutes) must also have learned, written its plot, and still print
the lines docs/demo.md quotes from it; the pictures exist, and so does every page the README
links. (The Rust blocks are doctests: docs/bundles.md of the op crate, the framework's README of
its crate.)"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = open(os.path.join(ROOT, "README.md")).read()
# The README, then the pages under docs/ in name order: every block of each is run.
PAGES = {"README.md": README} | {
    f"docs/{name}": open(os.path.join(ROOT, "docs", name)).read()
    for name in sorted(os.listdir(os.path.join(ROOT, "docs")))
    if name.endswith(".md")
}


def blocks(language, pages=PAGES):
    return [block for text in pages.values() for block in re.findall(rf"```{language}\n(.*?)```", text, re.S)]


def commands(pages=PAGES):
    found = []
    for block in blocks("bash", pages):
        for line in block.splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command and not command.startswith("#") and command not in found:
                found.append(command)
    return found


def test_the_readme_is_short_and_its_links_exist():
    # A newcomer's page: what it is, the two commands, one example per audience, links.
    assert len(README.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert {"docs/testing.md", "docs/stress.md", "crates/xla-ffi-bundles/README.md"} <= set(links)
    for link in links:
        assert os.path.exists(os.path.join(ROOT, link)), link


def test_the_readme_has_its_commands_and_examples():
    # The two commands of the contract, and the other entry points, are in the README itself.
    assert {"make demo", "make test", "make wheel"} <= set(commands({"README.md": README}))
    assert len(blocks("python", {"README.md": README})) >= 2 and len(blocks("python")) >= 5


def test_ci_runs_the_test_command():
    assert "make test" in open(os.path.join(ROOT, ".ci", "run")).read()


@pytest.mark.parametrize("code", blocks("python"), ids=lambda c: c.splitlines()[0][:40])
def test_python_example(code):
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_pictures_exist():
    pictures = [os.path.normpath(os.path.join(os.path.dirname(page), path))
                for page, text in PAGES.items() for path in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)]
    assert {"docs/demo_train.png", "docs/rmsnorm_cpu.png"} <= set(pictures)
    for path in pictures:
        with open(os.path.join(ROOT, path), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", path


def demo_quoted():
    """The demo's output as docs/demo.md quotes it (its first text block)."""
    return re.findall(r"```text\n(.*?)```", PAGES["docs/demo.md"], re.S)[0]


def check_demo(out):
    """`make demo` learned, wrote its plot, and still prints what docs/demo.md quotes: the held-out
    answers and the state story's counts (lines that depend on neither the machine nor its load)."""
    assert "learned: every run at least 90% held-out exact match: yes" in out, out[-3000:]
    quoted = [line for line in demo_quoted().splitlines()
              if re.match(r"  \d+\+\d+=|  (states instantiated|executions per state): ", line)]
    assert len(quoted) >= 12
    for line in quoted:
        assert line in out, f"docs/demo.md quotes a line the demo no longer prints:\n{line}\n\n{out[-3000:]}"
    plot = re.search(r"^plot: (\S+)$", out, re.M)
    assert plot, out[-3000:]
    with open(os.path.join(ROOT, plot.group(1)), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("command", [c for c in commands() if c != "make test"])
def test_shell_command(command, tmp_path):
    env = dict(os.environ, BENCH_ARGS=f"--quick --out {tmp_path}")
    result = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env
    )
    assert result.returncode == 0, f"{command}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    if command == "make demo":
        check_demo(result.stdout)
