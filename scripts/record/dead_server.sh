#!/usr/bin/env bash
# How long each real client takes to show the error when the server its conversation goes to
# is down (issue 19). Starts the router (mitmdump -s addons/route.py of REPO) with every
# agent's current server a loopback port nothing listens on, runs one one-shot prompt per
# client through it, and prints the seconds until the client exited and its last line.
#
# usage: scripts/record/dead_server.sh REC_DIR [REPO] [PORT] [CLIENTS...]
#   REC_DIR: the clients installed as docs/traffic.md "How to re-record" says
#            (REC_DIR/{claude,opencode,pi,codex}/node_modules/.bin/…)
#   REPO:    the sessionpin checkout whose router runs (default: this one; another one,
#            e.g. an export of an older commit, measures "before")
#   CLIENTS: any of claude opencode pi codex (default: all four)
# No request leaves the machine: inference is moved to the dead port; anything else is
# addressed to hosts that do not resolve here. Each client gets at most 300 s.
# STORE=redis://127.0.0.1:PORT/0 (a port where no Redis runs): the same with a store that
# cannot be read instead of a dead server.
set -uo pipefail
rec="$(cd "$1" && pwd)"; here="$(cd "$(dirname "$0")/../.." && pwd)"
repo="$(cd "${2:-$here}" && pwd)"; port="${3:-8897}"; shift $(( $# < 3 ? $# : 3 ))
clients=("${@:-claude opencode pi codex}"); clients=(${clients[*]})
work="$(mktemp -d)"; dead="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
cat > "$work/config.toml" <<EOF
[servers.anthropic]
url = "https://api.anthropic.com"
[servers.zen]
url = "https://opencode.ai/zen/v1"
[servers.openai]
url = "https://api.openai.com/v1"
[servers.dead]
url = "https://127.0.0.1:$dead"
key_env = "DEAD_SERVER_KEY"
[agents.claude-code]
server = "dead"
[agents.opencode]
server = "dead"
[agents.pi]
server = "dead"
[agents.codex]
server = "dead"
EOF
DEAD_SERVER_KEY=FAKE-dead-key PYTHONPATH="$repo" "$here/.venv/bin/mitmdump" --listen-host 127.0.0.1 -p "$port" \
  --set confdir="$work/mitm" -s "$repo/addons/route.py" --set sessionpin_config="$work/config.toml" \
  --set sessionpin_store="${STORE:-file:$work/state.db}" > "$work/mitmdump.log" 2>&1 &
proxy=$!
trap 'kill $proxy 2>/dev/null; wait $proxy 2>/dev/null' EXIT
for _ in $(seq 100); do grep -q "listening at" "$work/mitmdump.log" && break; sleep 0.1; done
ca="$work/mitm/mitmproxy-ca-cert.pem"
export HTTPS_PROXY="http://127.0.0.1:$port" HTTP_PROXY="http://127.0.0.1:$port" NO_PROXY= no_proxy= \
       NODE_EXTRA_CA_CERTS="$ca" SSL_CERT_FILE="$ca" CODEX_CA_CERTIFICATE="$ca" IS_SANDBOX=1 \
       ANTHROPIC_API_KEY=sk-ant-api03-FAKE-0123456789abcdef OPENCODE_API_KEY=sk-FAKE-0123456789abcdef \
       OPENAI_API_KEY=sk-proj-FAKE-0123456789abcdef CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 \
       OPENCODE_DISABLE_MODELS_FETCH=1 OPENCODE_DISABLE_AUTOUPDATE=1 PI_OFFLINE=1
mkdir -p "$work/proj"; cd "$work/proj"
for c in "${clients[@]}"; do
  export HOME="$work/home-$c"; mkdir -p "$HOME"
  case "$c" in
    claude)   cmd=("$rec/claude/node_modules/.bin/claude" -p 'Say hi.') ;;
    opencode) cmd=("$rec/opencode/node_modules/.bin/opencode" run -m opencode/glm-5.1 'Say hi.') ;;
    pi)       cmd=("$rec/pi/node_modules/.bin/pi" -p --model opencode/glm-5.1 'Say hi.') ;;
    codex)    echo "$OPENAI_API_KEY" | "$rec/codex/node_modules/.bin/codex" login --with-api-key > /dev/null 2>&1
              cmd=("$rec/codex/node_modules/.bin/codex" exec --skip-git-repo-check 'Say hi.') ;;
    *) echo "unknown client $c"; continue ;;
  esac
  mark=$(wc -l < "$work/mitmdump.log"); start=$(date +%s.%N)
  timeout 300 "${cmd[@]}" < /dev/null > "$work/$c.out" 2>&1; rc=$?
  end=$(date +%s.%N)
  # the router's first refusal of this client (its log's local time) to the client's exit
  first=$(tail -n +"$((mark + 1))" "$work/mitmdump.log" | grep -m1 -o '^\[[0-9:.]*\] sessionpin: refused' | cut -c2-13)
  since=$(python3 -c "
import datetime as d; t='$first'
if not t: print('-')
else:
    now = d.datetime.fromtimestamp($end); h, m, s = t.split(':')
    at = now.replace(hour=int(h), minute=int(m), second=int(float(s)), microsecond=int(float(s) % 1 * 1e6))
    print(f'{$end - at.timestamp():.1f}')")
  refusals=$(tail -n +"$((mark + 1))" "$work/mitmdump.log" | grep -c 'sessionpin: refused')
  last=$(grep -v '^\s*$' "$work/$c.out" | tail -n 1 | cut -c1-120)
  echo "$c: $(python3 -c "print(f'{$end - $start:.1f}')") s in all, ${since} s from the router's first refusal, $refusals refusals (exit $rc) — $last"
done
echo "router log: $work/mitmdump.log"
