"""tools/setup_env.sh keeps strict mode to itself: sourced, it leaves the caller's shell options
as they were (an interactive shell must survive a failed set-up), yet a caller with `set -e`
(tests/run.sh, .ci/run, examples/*.sh) still stops when the set-up fails."""
import os
import shutil
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tools", "setup_env.sh")
OPTIONS = 'echo "opts=$-;$(shopt -qo pipefail && echo pipefail)"'


def bash(script: str, cwd: str = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True,
                          timeout=60)


def broken_copy(tmp_path) -> str:
    """The script in a repository without requirements.txt: its set-up fails at once."""
    (tmp_path / "tools").mkdir()
    shutil.copy(SCRIPT, tmp_path / "tools" / "setup_env.sh")
    return str(tmp_path / "tools" / "setup_env.sh")


def test_sourcing_sets_the_paths_and_leaves_the_options():
    done = bash(f"source {SCRIPT} >/dev/null; {OPTIONS}; command -v python; "
                f'echo "pp=$PYTHONPATH"')
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    opts = out[0].split("=", 1)[1]
    assert "e" not in opts.split(";")[0] and "u" not in opts.split(";")[0], out
    assert not opts.endswith("pipefail"), out
    assert os.path.samefile(os.path.dirname(out[1]), os.path.join(REPO, ".venv", "bin"))
    assert out[2].split("=", 1)[1].split(":")[0] == REPO
    strict = bash(f"set -euo pipefail; source {SCRIPT} >/dev/null; {OPTIONS}")
    assert strict.returncode == 0, strict.stderr
    opts = strict.stdout.strip().split("=", 1)[1]
    assert "e" in opts.split(";")[0] and "u" in opts.split(";")[0] and opts.endswith("pipefail")


def test_a_failed_set_up_returns_to_an_interactive_caller(tmp_path):
    script = broken_copy(tmp_path)
    done = bash(f'source {script}; echo "status $?"; {OPTIONS}; echo alive')
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "status 1" and lines[-1] == "alive", lines
    assert "requirements.txt" in done.stderr


def test_a_failed_set_up_stops_a_strict_caller_and_a_direct_run(tmp_path):
    script = broken_copy(tmp_path)
    strict = bash(f"set -euo pipefail; source {script}; echo after")
    assert strict.returncode != 0 and "after" not in strict.stdout
    direct = subprocess.run(["bash", script], capture_output=True, text=True, timeout=60)
    assert direct.returncode != 0 and not (tmp_path / ".venv").exists()
