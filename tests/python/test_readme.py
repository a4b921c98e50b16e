"""Every command and Python example in README.md runs: the Python blocks in fresh interpreters,
the shell commands through bash from the repo root. `make test` is what CI runs (`.ci/run`);
`make bench` runs here with `--quick` (the full suite takes minutes)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = open(os.path.join(ROOT, "README.md")).read()


def blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def commands():
    found = []
    for block in blocks("bash"):
        for line in block.splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command and not command.startswith("#"):
                found.append(command)
    return found


def test_the_readme_has_its_commands_and_examples():
    # The two commands of the contract, and the other entry points, are documented.
    assert {"make demo", "make test"} <= set(commands())
    assert len(blocks("python")) >= 3


def test_ci_runs_the_test_command():
    assert "make test" in open(os.path.join(ROOT, ".ci", "run")).read()


@pytest.mark.parametrize("code", blocks("python"), ids=lambda c: c.splitlines()[0][:40])
def test_python_example(code):
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("command", [c for c in commands() if c != "make test"])
def test_shell_command(command, tmp_path):
    env = dict(os.environ, BENCH_ARGS=f"--quick --out {tmp_path}")
    result = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env
    )
    assert result.returncode == 0, f"{command}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
