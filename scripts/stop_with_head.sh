#!/usr/bin/env bash
# Stops this worker node's Ray when the head's Ray stops. cluster.yaml's worker start commands run it after
# `ray start` (usage: stop_with_head.sh HEAD_IP [GCS_PORT]); it detaches and returns at once.
#
# Why: `ray down` runs `ray stop` on the head only; Ray's local provider cannot stop a worker (its
# terminate_node only forgets the machine). A worker whose head is gone keeps its raylet until the GCS
# reconnect timeout (about a minute) and its log monitor, dashboard agent and runtime-env agent after that.
#
# Every 2 s the watcher connects to the head's GCS port. When the head's machine answers but nothing
# listens there (connection refused: its Ray stopped) twice in a row, or this node's raylet has exited
# (lost its head, or `ray stop` here), it ends the processes of the Ray session it was started for (SIGTERM,
# SIGKILL after 10 s) and exits. Those are the processes of this user whose command line or open files name
# the session's folder (the agents rename themselves, so their command lines do not say; their log files
# there are open; the log monitor's command line names it). A head that does not answer at all (network down) is left to Ray's own timeout, and a
# newer session on this node (the start commands run again) is never touched.
set -uo pipefail
head="${1:?usage: stop_with_head.sh HEAD_IP [GCS_PORT]}"
port="${2:-6379}"
ray_tmp="${RAY_TMP:-/tmp/ray}"  # Ray's default --temp-dir, which cluster.yaml keeps
session="$(readlink -f "$ray_tmp/session_latest")"
raylet="$(pgrep -u "$(id -u)" -x raylet | head -1)"
if [ -z "$raylet" ] || [[ "$(basename "$session")" != session_* ]]; then
  echo "[stop_with_head] no raylet or Ray session on $(hostname): nothing to watch"
  exit 0
fi

setsid nohup bash -c '
  head="$1"; port="$2"; raylet="$3"; session="$4"
  refused=0
  while kill -0 "$raylet" 2>/dev/null && [ "$refused" -lt 2 ]; do
    sleep 2
    timeout 3 bash -c ": </dev/tcp/$head/$port" 2>/dev/null; rc=$?
    if [ "$rc" = 1 ]; then refused=$((refused + 1)); else refused=0; fi  # 1: refused; 124: no answer
  done
  of_session() {
    for p in $(pgrep -u "$(id -u)"); do
      cmd="$(tr "\0" " " < "/proc/$p/cmdline" 2>/dev/null)"
      case "$cmd" in *synth-grpo-stop-with-head*) continue ;; esac  # this watcher and its subshells
      if [[ "$cmd" == *"$session"* ]] || ls -l "/proc/$p/fd" 2>/dev/null | grep -qF -- "$session"; then echo "$p"; fi
    done
  }
  pids="$(of_session)"; [ -n "$pids" ] && kill -TERM $pids 2>/dev/null
  for _ in $(seq 10); do pids="$(of_session)"; [ -z "$pids" ] && exit 0; sleep 1; done
  kill -KILL $pids 2>/dev/null
' synth-grpo-stop-with-head "$head" "$port" "$raylet" "$session" >/dev/null 2>&1 < /dev/null &
echo "[stop_with_head] Ray on $(hostname) stops when the head's Ray at $head:$port stops (watcher pid $!)"
