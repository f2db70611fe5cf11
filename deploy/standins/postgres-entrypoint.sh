#!/usr/bin/env bash
# Entrypoint of the CI stand-in for the official postgres image (deploy/standins/postgres.Containerfile).
# The interface docker-compose.yml relies on, as the official docker-entrypoint.sh defines it:
#   - `postgres ARGS...` (or just `-c ...`) runs the server as user postgres, with ARGS;
#   - an empty data directory is initialised first: superuser POSTGRES_USER (default postgres) with
#     POSTGRES_PASSWORD (required), database POSTGRES_DB (default: the user's name), password
#     (scram-sha-256) authentication for every network client, trust on the local socket;
#   - a data directory that is already initialised is used as it is (the variables are ignored);
#   - any other command runs as given.
set -Eeuo pipefail

if [[ "${1:-}" == -* ]]; then
  set -- postgres "$@"
fi
if [[ "${1:-}" != postgres ]]; then
  exec "$@"
fi

if [[ "$(id -u)" == 0 ]]; then
  # A fresh named volume belongs to root: hand it to postgres, then drop privileges.
  install -d -o postgres -g postgres -m 0700 "$PGDATA"
  install -d -o postgres -g postgres -m 2775 /var/run/postgresql
  exec setpriv --reuid=postgres --regid=postgres --init-groups "${BASH_SOURCE[0]}" "$@"
fi

: "${POSTGRES_USER:=postgres}"
: "${POSTGRES_DB:=$POSTGRES_USER}"

if [[ ! -s "$PGDATA/PG_VERSION" ]]; then
  if [[ -z "${POSTGRES_PASSWORD:-}" ]]; then
    echo "docker-entrypoint.sh: the database is uninitialised and POSTGRES_PASSWORD is not set" >&2
    exit 1
  fi
  initdb --username="$POSTGRES_USER" --pwfile=<(printf '%s\n' "$POSTGRES_PASSWORD") \
    --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 -D "$PGDATA" >/dev/null
  printf "listen_addresses = '*'\n" >>"$PGDATA/postgresql.conf"
  printf 'host all all all scram-sha-256\n' >>"$PGDATA/pg_hba.conf"
  # A server on the socket only, so nothing connects over the network before setup is done.
  pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w -s start
  if [[ "$POSTGRES_DB" != postgres ]]; then
    psql -X -q -v ON_ERROR_STOP=1 -v db="$POSTGRES_DB" --username="$POSTGRES_USER" --dbname=postgres \
      <<<'CREATE DATABASE :"db";'
  fi
  pg_ctl -D "$PGDATA" -m fast -w -s stop
  echo "docker-entrypoint.sh: initialised $PGDATA (user $POSTGRES_USER, database $POSTGRES_DB)"
fi

shift
exec postgres "$@"
