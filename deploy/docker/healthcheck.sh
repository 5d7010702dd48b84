#!/bin/bash
# Container health check without curl: one HTTP/1.0 GET over bash's /dev/tcp.
#
#   voucher-cdc-healthcheck [URL [HEADER...]]
#
# URL defaults to $HEALTHCHECK_URL, else http://127.0.0.1:9464/healthz (the
# daemon's liveness endpoint). Extra arguments are sent as request headers,
# e.g. "Authorization: Bearer demo-token". Exits 0 on a 2xx status, 1 otherwise.
set -uo pipefail

url="${1:-${HEALTHCHECK_URL:-http://127.0.0.1:9464/healthz}}"
shift $(( $# > 0 ? 1 : 0 ))

rest="${url#http://}"
if [[ "$rest" == "$url" ]]; then
  echo "healthcheck: only http:// URLs are supported, got ${url}" >&2
  exit 1
fi
hostport="${rest%%/*}"
path="/"
[[ "$rest" == */* ]] && path="/${rest#*/}"
host="${hostport%:*}"
port="${hostport##*:}"
[[ "$port" == "$hostport" ]] && port=80

if ! exec 3<>"/dev/tcp/${host}/${port}"; then
  echo "healthcheck: cannot connect to ${host}:${port}" >&2
  exit 1
fi
{
  printf 'GET %s HTTP/1.0\r\nHost: %s\r\nConnection: close\r\n' "$path" "$hostport"
  for header in "$@"; do
    printf '%s\r\n' "$header"
  done
  printf '\r\n'
} >&3

if ! read -r -t 5 _protocol status _reason <&3; then
  echo "healthcheck: no response from ${url}" >&2
  exit 1
fi
exec 3<&-
if [[ "$status" =~ ^2[0-9][0-9]$ ]]; then
  exit 0
fi
echo "healthcheck: ${url} answered ${status:-nothing}" >&2
exit 1
