#!/usr/bin/env bash
# Creates (or reuses) the project virtualenv at .venv and installs requirements.txt into it.
# torch==2.13.0 goes in first: a later unpinned requirement then finds it satisfied.
# Sourced (`source tools/setup_env.sh`), it runs that set-up as a child bash and then puts .venv's
# python on PATH and the repository on PYTHONPATH; the caller's shell options are left as they
# were (strict mode stays inside the set-up): an interactive shell survives a failed set-up
# (status 1), a caller with `set -e` stops on it.
if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
  _setup_env_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  bash "$_setup_env_repo/tools/setup_env.sh" || { unset _setup_env_repo; return 1; }
  export PATH="$_setup_env_repo/.venv/bin:$PATH"
  export PYTHONPATH="$_setup_env_repo${PYTHONPATH:+:$PYTHONPATH}"
  unset _setup_env_repo
  return 0
fi
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv"
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$repo/requirements.txt" | cut -d' ' -f1)"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] reusing $venv"
else
  echo "[setup] creating $venv (torch 2.13.0 first, then requirements.txt)"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
  "$venv/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$repo/requirements.txt" 2>&1 | grep -v '^WARNING: Location' || true
  "$venv/bin/python" -c "import torch, megatron.core, sentencepiece, tokenizers, numpy, scipy" \
    || { echo "[setup] install failed: see pip output above" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
