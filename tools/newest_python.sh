#!/usr/bin/env sh
# Print the path of the newest CPython 3 on this machine: python3.N on PATH, and pyenv's versions.
# Used by `make test-newest`, which tests the chapters on the newest releases pip resolves.
set -eu
best=""
best_key=0
for candidate in $(command -v python3 python3.9 python3.10 python3.11 python3.12 python3.13 \
                   python3.14 python3.15 python3.16 2>/dev/null) \
                 ${PYENV_ROOT:-$HOME/.pyenv}/versions/*/bin/python3; do
    [ -x "$candidate" ] || continue
    # a version that cannot make a venv (no ensurepip) is of no use here
    key=$("$candidate" -c 'import ensurepip, sys; print(sys.version_info[0] * 1000 + sys.version_info[1])' \
          2>/dev/null) || continue
    if [ "$key" -gt "$best_key" ]; then
        best_key=$key
        best=$("$candidate" -c 'import sys; print(sys.executable)')
    fi
done
if [ -z "$best" ]; then
    echo "no Python 3 found" >&2
    exit 1
fi
echo "$best"
