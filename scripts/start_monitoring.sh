#!/usr/bin/env bash
# Prometheus (and Grafana where it is installed) for the Ray head, both on 127.0.0.1, for the dashboard's
# Metrics view and the synth-grpo Grafana dashboard. cluster.yaml runs this on the head after `ray start`.
#
# Prometheus: the system package's `prometheus` when installed (nothing downloaded). Without it nothing
# is downloaded unless SYNTH_GRPO_DOWNLOAD_PROMETHEUS=1 opts in to `ray metrics launch-prometheus`
# (an unpinned binary from GitHub that listens on every interface). Either way it reads the config Ray
# writes for its session, which scrapes every node listed in Ray's service-discovery file. Grafana:
# started with the grafana.ini and provisioning Ray writes, plus docs/grafana/synth_grpo_dashboard.json.
# Run again, it replaces what it started before (a new Ray session has new config). A watcher stops
# both when this user's Ray stops (`ray stop`, `ray down`), so nothing is left running.
#
# Its state (pid files, data, logs) is in a folder only this user can enter (0700, default
# ~/.cache/synth-grpo/monitoring, SYNTH_GRPO_MONITORING_DIR): a shared head's other users cannot plant
# a pid file it would act on; a pid file is used only when it holds a number, a process of this user.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
ray_tmp="${RAY_TMP:-/tmp/ray}"  # Ray's default --temp-dir, which cluster.yaml keeps
session="$(readlink -f "$ray_tmp/session_latest")"
state="${SYNTH_GRPO_MONITORING_DIR:-$HOME/.cache/synth-grpo/monitoring}"
say() { echo "[monitoring] $*"; }

(umask 077 && mkdir -p "$state")
if [ -L "$state" ] || [ ! -O "$state" ]; then
  say "ERROR: $state is a link or is not owned by $(id -un): not using it"
  exit 1
fi
chmod 700 "$state"

# A pid this script recorded: a number, and a live process of this user (else the file is stale or planted).
our_pid() {
  local pid
  pid="$(head -c 32 "$1" 2>/dev/null | tr -d '[:space:]')"
  [[ "$pid" =~ ^[0-9]+$ ]] && [ "$(ps -o uid= -p "$pid" 2>/dev/null | tr -d ' ')" = "$(id -u)" ] && echo "$pid"
}

# Replace what an earlier run started.
for f in "$state"/*.pid; do
  [ -f "$f" ] || continue
  pid="$(our_pid "$f")"
  if [ -n "$pid" ]; then
    kill -- "$pid" 2>/dev/null && for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  fi
  rm -f "$f"
done

prom_cfg="$session/metrics/prometheus/prometheus.yml"
for _ in $(seq "${SYNTH_GRPO_MONITORING_WAIT_S:-60}"); do [ -f "$prom_cfg" ] && break; sleep 1; done  # the dashboard writes it shortly after start
if [ ! -f "$prom_cfg" ]; then
  say "WARNING: $prom_cfg was not written (is the dashboard running?): no Prometheus started"
elif command -v prometheus >/dev/null; then
  setsid nohup prometheus --config.file="$prom_cfg" --web.listen-address=127.0.0.1:9090 \
    --storage.tsdb.path="$state/prometheus-data" >"$state/prometheus.log" 2>&1 < /dev/null &
  echo $! > "$state/prometheus.pid"
  say "Prometheus $(prometheus --version 2>&1 | head -1 | awk '{print $3}') on 127.0.0.1:9090 (system package), scraping the nodes in Ray's service-discovery file"
elif [ "${SYNTH_GRPO_DOWNLOAD_PROMETHEUS:-0}" != 1 ]; then
  say "no prometheus on PATH: none started (install the system package: apt-get install prometheus; or set SYNTH_GRPO_DOWNLOAD_PROMETHEUS=1 to let \`ray metrics launch-prometheus\` download one, which listens on every interface)"
else
  say "SYNTH_GRPO_DOWNLOAD_PROMETHEUS=1: \`ray metrics launch-prometheus\` downloads Prometheus; it listens on every interface, keep port 9090 firewalled"
  (cd "$state" && timeout 300 ray metrics launch-prometheus >"$state/launch-prometheus.log" 2>&1)
  pid="$(grep -o 'running with PID [0-9]*' "$state/launch-prometheus.log" | grep -o '[0-9]*$')"
  if [ -n "$pid" ]; then
    echo "$pid" > "$state/prometheus.pid"
    say "Prometheus (downloaded) on :9090, pid $pid"
  else
    say "WARNING: could not download Prometheus (see $state/launch-prometheus.log); install the system package: apt-get install prometheus"
  fi
fi

grafana_bin="$(command -v grafana || command -v grafana-server || true)"
grafana_dir="$session/metrics/grafana"
if [ -z "$grafana_bin" ]; then
  say "Grafana is not installed on the head: the dashboard's Metrics view shows 'Set up Grafana' (docs/cluster.md); Prometheus alone answers queries on 127.0.0.1:9090"
elif [ ! -f "$grafana_dir/grafana.ini" ]; then
  say "WARNING: $grafana_dir/grafana.ini was not written: Grafana not started"
else
  cp "$repo/docs/grafana/synth_grpo_dashboard.json" "$grafana_dir/dashboards/"
  [ "$(basename "$grafana_bin")" = grafana ] && sub=server || sub=
  setsid nohup "$grafana_bin" $sub --homepath "${GRAFANA_HOME:-/usr/share/grafana}" --config "$grafana_dir/grafana.ini" \
    cfg:server.http_addr=127.0.0.1 cfg:paths.data="$state/grafana-data" web >"$state/grafana.log" 2>&1 < /dev/null &
  echo $! > "$state/grafana.pid"
  say "Grafana on 127.0.0.1:3000 with Ray's dashboards and synth-grpo training"
fi

# Stop both when this user's Ray stops: `ray down` runs `ray stop` on the head, which knows nothing of them.
pids=()
for f in "$state"/prometheus.pid "$state"/grafana.pid; do
  [ -f "$f" ] && pid="$(our_pid "$f")" && pids+=("$pid")
done
if [ "${#pids[@]}" -gt 0 ]; then
  # the pids are arguments of the watcher, never part of its code
  setsid nohup bash -c 'uid="$1"; shift; while pgrep -u "$uid" -x gcs_server >/dev/null; do sleep 5; done; kill -- "$@" 2>/dev/null' \
    synth-grpo-monitoring-watcher "$(id -u)" "${pids[@]}" >/dev/null 2>&1 < /dev/null &
  echo $! > "$state/watcher.pid"
fi
exit 0
