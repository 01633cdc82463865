# Sourced by scripts/proxy and scripts/test: make .venv with Python >= 3.12 and install sessionpin.
# Usage: EXTRAS=test . scripts/bootstrap.sh   (EXTRAS optional; sets $ROOT and $VENV)
# (Not a positional argument: a sourced file sees its caller's arguments.)
# A fresh machine of this kind has python3 = 3.11 and 3.12/3.13 under pyenv, so we look there too.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
extras="${EXTRAS:-}"

find_python() {
    local c v
    for c in "${SESSIONPIN_PYTHON:-}" python3.12 python3.13 python3; do
        [ -n "$c" ] || continue
        if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
            command -v "$c"; return 0
        fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])(\.|$)' | sort -V); do
            c="$(pyenv root)/versions/$v/bin/python3"
            if [ -x "$c" ]; then echo "$c"; return 0; fi
        done
    fi
    return 1
}

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    py=$(find_python) || { echo "sessionpin needs Python >= 3.12 (mitmproxy 12). Install it (e.g. 'pyenv install 3.12') or set SESSIONPIN_PYTHON." >&2; exit 1; }
    echo "creating $VENV with $py" >&2
    rm -rf "$VENV"
    "$py" -m venv "$VENV"
fi

# Reinstall only when the project's metadata changed (or the extras asked for did).
stamp="$VENV/.sessionpin-installed${extras:+-$extras}"
want=$(cat "$ROOT/pyproject.toml" | cksum)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    spec="$ROOT"
    [ -n "$extras" ] && spec="$ROOT[$extras]"
    echo "installing sessionpin${extras:+[$extras]} into $VENV" >&2
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q -e "$spec" >&2
    echo "$want" > "$stamp"
fi

# The tests run real Redis servers (the Redis store's tests are skipped nowhere): find
# redis-server, install it with apt when we are root and can, else stop and say so.
find_redis_server() {
    local c
    for c in "${SESSIONPIN_REDIS_SERVER:-}" "$(command -v redis-server 2>/dev/null || true)" \
             /usr/sbin/redis-server /usr/bin/redis-server; do
        if [ -n "$c" ] && [ -x "$c" ]; then echo "$c"; return 0; fi
    done
    return 1
}
if [ "$extras" = test ]; then
    if ! redis_server=$(find_redis_server); then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            echo "installing redis-server with apt-get (the Redis store tests start their own servers)" >&2
            { apt-get install -y -q redis-server || { apt-get update -q && apt-get install -y -q redis-server; }; } >&2 || true
        fi
        redis_server=$(find_redis_server) || {
            echo "scripts/test: redis-server not found (looked at \$SESSIONPIN_REDIS_SERVER, PATH, /usr/sbin, /usr/bin)." >&2
            echo "The Redis store tests start real servers: install it (Debian/Ubuntu: apt-get install redis-server; it includes redis-cli) or set SESSIONPIN_REDIS_SERVER." >&2
            exit 1
        }
    fi
    export SESSIONPIN_REDIS_SERVER="$redis_server"
fi
