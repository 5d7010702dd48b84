# shellcheck shell=bash
# Shared by the benchmark scripts (sourced, not run): the processes a
# benchmark starts, killed on exit, its run directory, and a free port.
#
# The sourcing script sets RUN_DIR, KEEP (1 keeps RUN_DIR) and, optionally,
# STOP_WAIT (tenths of a second a process gets after SIGTERM before SIGKILL),
# appends the pid of every process it starts to `pids`, and calls
# `install_cleanup` once.

pids=()

cleanup() {
  local pid
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 "${STOP_WAIT:-50}"); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
  done
  if [ "$KEEP" -eq 1 ]; then
    echo "run directory kept: $RUN_DIR" >&2
  else
    rm -rf "$RUN_DIR"
  fi
}

install_cleanup() {
  trap cleanup EXIT
  trap 'exit 130' INT TERM
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
