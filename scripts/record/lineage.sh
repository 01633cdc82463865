#!/usr/bin/env bash
# Record the lineage scenarios (docs/traffic.md, "Lineage"): every client's resume and fork, the
# responses they were given, Codex's WebSocket, and pi's same-prompt conversations.
#
# usage: scripts/record/lineage.sh REC [PORT]
#   REC   a scratch directory holding the clients installed as docs/traffic.md says
#         (REC/claude, REC/opencode, REC/pi, REC/codex); flows go to REC/flows, the agents run in
#         REC/proj, each scenario with its own throwaway HOME under REC/home-*.
#   PORT  the recording proxy's port (default 8899).
# Then: .venv/bin/python scripts/record/to_fixtures.py REC/flows tests/fixtures/traffic cc-lineage ...
#
# Only fake keys are used; the fake upstream (FAKE_LINEAGE=1) makes every answer.
set -euo pipefail
rec="$(cd "$1" && pwd)"; port="${2:-8899}"
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$rec/flows" "$rec/proj" "$rec/mitm"
ca="$rec/mitm/mitmproxy-ca-cert.pem"
proxy_pid=""

start_proxy() {  # start_proxy NAME [ENV=VALUE...]: a fresh flow file per scenario
  local name="$1"; shift
  env FAKE_LINEAGE=1 "$@" "$here/proxy.sh" "$rec/flows/$name.flow" "$port" "$rec/mitm" >"$rec/proxy-$name.log" 2>&1 &
  proxy_pid=$!
  for _ in $(seq 50); do [ -s "$ca" ] && grep -q "listening" "$rec/proxy-$name.log" && return; sleep 0.2; done
  echo "proxy for $name did not start" >&2; exit 1
}
stop_proxy() { kill "$proxy_pid"; wait "$proxy_pid" 2>/dev/null || true; }
trap '[ -n "$proxy_pid" ] && kill "$proxy_pid" 2>/dev/null || true' EXIT

export HTTPS_PROXY="http://127.0.0.1:$port" HTTP_PROXY="http://127.0.0.1:$port" NO_PROXY= \
  NODE_EXTRA_CA_CERTS="$ca" SSL_CERT_FILE="$ca" CODEX_CA_CERTIFICATE="$ca" IS_SANDBOX=1 \
  ANTHROPIC_API_KEY=sk-ant-api03-FAKEkey0123456789abcdefghij OPENCODE_API_KEY=sk-FAKEkey0123456789abcdef \
  OPENAI_API_KEY=sk-proj-FAKEkey0123456789abcdef \
  OPENCODE_DISABLE_MODELS_FETCH=1 OPENCODE_DISABLE_AUTOUPDATE=1 PI_OFFLINE=1
PATH="$rec/claude/node_modules/.bin:$rec/opencode/node_modules/.bin:$rec/pi/node_modules/.bin:$rec/codex/node_modules/.bin:$PATH"
cd "$rec/proj"
t() { timeout 180 "$@"; }

# Claude Code: a conversation with a tool round, --resume (same id), --resume --fork-session (new id).
start_proxy cc-lineage; export HOME="$rec/home-cc-lineage"; mkdir -p "$HOME"
json_id() { python3 -c 'import json,sys; print(json.load(sys.stdin)["session_id"])'; }
id=$(t claude -p 'RUNTOOL: run echo hi in the shell' --allowedTools 'Bash(echo:*)' --output-format json | json_id)
t claude -p --resume "$id" 'RUNTOOL: resumed, run echo hi' --allowedTools 'Bash(echo:*)' --output-format json >/dev/null
t claude -p --resume "$id" --fork-session 'RUNTOOL: forked, run echo hi' --allowedTools 'Bash(echo:*)' --output-format json >/dev/null
stop_proxy

# opencode: run, run -s ID (resume), run -s ID --fork; on /zen/v1/messages and on /zen/v1/responses.
for pair in "oc-lineage opencode/claude-sonnet-4-5" "oc-lineage-gpt opencode/gpt-5.1-codex"; do
  set -- $pair
  start_proxy "$1"; export HOME="$rec/home-$1"; mkdir -p "$HOME"
  t opencode run -m "$2" 'RUNTOOL: run echo hi in the shell' >/dev/null
  id=$(t opencode session list | grep -o 'ses_[A-Za-z0-9]*' | head -1)
  t opencode run -s "$id" 'RUNTOOL: resumed, run echo hi' >/dev/null
  t opencode run -s "$id" --fork 'RUNTOOL: forked, run echo hi' >/dev/null
  stop_proxy
done

# Codex: exec, exec resume ID, exec fork ID; first with the WebSocket refused (426, HTTPS POSTs),
# then with it accepted (FAKE_WEBSOCKET=1: every turn goes over the socket).
for pair in "cx-lineage 0" "cx-ws 1"; do
  set -- $pair
  start_proxy "$1" FAKE_WEBSOCKET="$2"; export HOME="$rec/home-$1"; mkdir -p "$HOME"
  echo "$OPENAI_API_KEY" | t codex login --with-api-key >/dev/null
  cx() { t codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox "$@" 2>&1; }
  id=$(cx 'RUNTOOL: run echo hi in the shell' | sed -n 's/^session id: //p')
  cx resume "$id" 'RUNTOOL: resumed, run echo hi' >/dev/null
  cx fork "$id" 'RUNTOOL: forked, run echo hi' >/dev/null
  stop_proxy
done

# pi: two conversations opened with the same prompt in the same directory, each continued once,
# then a fork of the first; through chat/completions, messages and responses.
for pair in "pi-lineage-chat opencode/glm-5.1" "pi-lineage-messages opencode/claude-sonnet-4-5" \
            "pi-lineage-responses opencode/gpt-5.1-codex"; do
  set -- $pair
  start_proxy "$1"; export HOME="$rec/home-$1"; mkdir -p "$HOME"
  t pi -p --model "$2" "Say hello in one word." >/dev/null
  t pi -p --model "$2" -c "Now say it in French." >/dev/null
  first=$(ls "$HOME"/.pi/agent/sessions/*/*.jsonl)
  sleep 1  # pi names session files by the second
  t pi -p --model "$2" "Say hello in one word." >/dev/null
  t pi -p --model "$2" -c "Now say it in French." >/dev/null
  t pi -p --model "$2" --fork "$first" "Now say it in German." >/dev/null
  stop_proxy
done
echo "flows in $rec/flows"
