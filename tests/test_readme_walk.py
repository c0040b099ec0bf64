"""README's `## Walkthrough`, run as printed, so that README cannot drift from what works: every command line
of the section's ```bash blocks, verbatim and in order, in a copy of the repository set up as a clone is
after `make tools` (its own .venv, whose packages are this venv's), each run through `ARGS` at a few
steps (the Makefile's train targets append it). Each command must exit 0 and print what the `# prints:`
comment lines under it say; a command with a `# serves: URL` line under it (TensorBoard) must answer
there, and is then stopped."""

import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest

from fixtures import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2  # a run of the walk trains this many steps: enough for every file and line a run writes
STAMPS = (".installed", ".installed-tools", ".installed-dev")  # the Makefile's: what make has installed


def walk_commands(readme: str) -> list[tuple[str, list[str], str | None]]:
    """(command, the texts its `# prints:` lines say, its `# serves:` URL or None) of each command line of the
    ```bash blocks under `## Walkthrough`, a line continued with a backslash joined to the next."""
    section = re.search(r"^## Walkthrough\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert section, "README.md has no `## Walkthrough` section"
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", section.group(1), re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("# prints:"):
                commands[-1][1].append(line.removeprefix("# prints:").strip())
            elif line.startswith("# serves:"):
                commands[-1] = (*commands[-1][:2], line.removeprefix("# serves:").strip())
            elif line and not line.startswith("#"):
                commands.append((line, [], None))
    assert commands, "README's walkthrough has no ```bash block"
    return commands


def clone(destination) -> str:
    """The repository's files (tracked, and new ones git does not ignore) in `destination`, and a .venv
    there of this venv's packages, stamped as installed: what a clone is after `make tools`."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in listed:
        if name and os.path.isfile(os.path.join(ROOT, name)) and not name.startswith(".venv"):
            os.makedirs(os.path.join(destination, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(destination, name))
    venv, ours = os.path.realpath(os.path.join(ROOT, ".venv")), os.path.join(destination, ".venv")
    os.mkdir(ours)
    for entry in os.listdir(venv):
        if entry not in STAMPS and not entry.startswith(".venv"):
            os.symlink(os.path.join(venv, entry), os.path.join(ours, entry))
    for stamp in STAMPS:  # after the copies, so newer than the requirements files: make installs nothing
        open(os.path.join(ours, stamp), "w").close()
    return str(destination)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def serve(command: str, url: str, cwd: str, env: dict) -> str:
    """Starts `command`, waits until `url` answers (up to a minute), stops it; returns its output."""
    server = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not answers(url) and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert server.poll() is None and answers(url), f"{command!r} does not serve {url}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        output = server.communicate(timeout=30)[0]
    return output


def run_walk(commands, repository: str):
    """Runs each command in `repository` as README's reader would, with ARGS set; checks what it prints."""
    # as a user's shell: no simulated devices but what a command sets; this copy's modules imported
    env = {**child_env(devices=None), "ARGS": f"training.steps={STEPS}", "PYTHONPATH": repository}
    for command, printed, url in commands:
        started = time.monotonic()
        if url:
            output = serve(command, url, repository, env)
        else:
            result = subprocess.run(["bash", "-c", command], cwd=repository, env=env, capture_output=True, text=True,
                                    timeout=600)
            output = result.stdout + result.stderr
            assert result.returncode == 0, f"{command!r} exited {result.returncode}:\n{output[-3000:]}"
        for text in printed:
            assert text in output, f"{command!r} did not print {text!r}:\n{output[-3000:]}"
        print(f"{time.monotonic() - started:6.1f} s  {command}")


@pytest.mark.slow
def test_every_command_of_readmes_walkthrough_runs_as_printed(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        commands = walk_commands(f.read())
    run_walk(commands, clone(tmp_path / "seqax"))
