#!/usr/bin/env bash
# Installs PostgreSQL (Debian's package) when no /usr/lib/postgresql/*/bin/pg_ctl exists, for the
# tests that start a private server on 127.0.0.1: durable/tests/run.sh and the hosts' durable
# tests (host-bindings/*/ci.sh). Prints the bin directory of the newest installed version.
set -euo pipefail
if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
fi
dirname "$(ls /usr/lib/postgresql/*/bin/pg_ctl | sort -V | tail -1)"
