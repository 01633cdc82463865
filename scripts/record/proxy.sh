#!/usr/bin/env bash
# Start the fake upstream behind mitmdump, writing every flow to FLOWFILE.
# usage: scripts/record/proxy.sh FLOWFILE [PORT] [CONFDIR]
# The CA to trust is CONFDIR/mitmproxy-ca-cert.pem (CONFDIR defaults to ./.record-mitm).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
flow="$1"; port="${2:-8899}"; confdir="${3:-.record-mitm}"
mitmdump="${MITMDUMP:-$here/../../.venv/bin/mitmdump}"
exec "$mitmdump" --listen-host 127.0.0.1 -p "$port" --set confdir="$confdir" \
  --set connection_strategy=lazy -s "$here/fake_upstream.py" -w "$flow"
