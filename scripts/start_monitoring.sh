#!/usr/bin/env bash
# Prometheus (and Grafana where it is installed) for the Ray head, both on 127.0.0.1, for the dashboard's
# Metrics view and the synth-grpo Grafana dashboard. cluster.yaml runs this on the head after `ray start`.
#
# Prometheus: the system package's `prometheus` when installed (nothing downloaded), otherwise
# `ray metrics launch-prometheus` (downloads Prometheus from GitHub, listens on every interface).
# Either way it reads the config Ray writes for its session, which scrapes every node listed in Ray's
# service-discovery file. Grafana: started with the grafana.ini and provisioning Ray writes, plus
# docs/grafana/synth_grpo_dashboard.json. Run again, it replaces what it started before (a new Ray
# session has new config). A watcher stops both when this user's Ray stops (`ray stop`, `ray down`),
# so nothing is left running. Its files are under $RAY_TMP/synth-grpo-monitoring/.
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
ray_tmp="${RAY_TMP:-/tmp/ray}"  # Ray's default --temp-dir, which cluster.yaml keeps
session="$(readlink -f "$ray_tmp/session_latest")"
state="$ray_tmp/synth-grpo-monitoring"
mkdir -p "$state"
say() { echo "[monitoring] $*"; }

# Replace what an earlier run started (its pids are ours: recorded below).
for f in "$state"/*.pid; do
  [ -e "$f" ] || continue
  pid="$(cat "$f")"
  kill "$pid" 2>/dev/null && for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  rm -f "$f"
done

prom_cfg="$session/metrics/prometheus/prometheus.yml"
for _ in $(seq 60); do [ -f "$prom_cfg" ] && break; sleep 1; done  # the dashboard writes it shortly after start
if [ ! -f "$prom_cfg" ]; then
  say "WARNING: $prom_cfg was not written (is the dashboard running?): no Prometheus started"
elif command -v prometheus >/dev/null; then
  setsid nohup prometheus --config.file="$prom_cfg" --web.listen-address=127.0.0.1:9090 \
    --storage.tsdb.path="$state/prometheus-data" >"$state/prometheus.log" 2>&1 < /dev/null &
  echo $! > "$state/prometheus.pid"
  say "Prometheus $(prometheus --version 2>&1 | head -1 | awk '{print $3}') on 127.0.0.1:9090 (system package), scraping the nodes in Ray's service-discovery file"
else
  say "no prometheus on PATH: trying \`ray metrics launch-prometheus\` (downloads it; it listens on every interface, keep port 9090 firewalled)"
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
pids="$(cat "$state"/*.pid 2>/dev/null | tr '\n' ' ')"
if [ -n "$pids" ]; then
  setsid nohup bash -c "while pgrep -u $(id -u) -x gcs_server >/dev/null; do sleep 5; done; kill $pids 2>/dev/null" \
    >/dev/null 2>&1 < /dev/null &
  echo $! > "$state/watcher.pid"
fi
exit 0
