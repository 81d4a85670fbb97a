#!/usr/bin/env bash
# deploy/docker-compose.yml with podman-compose, on a host with podman and no Docker daemon.
#
#   deploy/podman/compose.sh up [--scale worker=2]   up -d, then wait until each service is healthy
#   deploy/podman/compose.sh wait                    wait for health again (after a restart)
#   deploy/podman/compose.sh down                    down -v, then check no container, volume or
#                                                    network of the project is left
#   deploy/podman/compose.sh ARGS...                 any other podman-compose command (ps, logs ...)
#
# Why a wrapper: podman-compose reads `depends_on: {condition: service_healthy}` only with podman
# 4.6 or later (it asks `podman wait --condition=healthy`), podman runs HEALTHCHECKs from systemd
# timers (none here: nothing would ever turn healthy), and podman 4.3 cannot start a container
# whose --requires chain holds an exited one-shot ("generating dependency graph ... not found in
# input list"). So `up` walks the compose file's depends_on order itself, one stage at a time
# (`up --no-deps`, no --requires): the one-shots `secrets` and `convert` must exit 0, then redis,
# the KV store, the scheduler with the workers (it turns healthy once one registered), the
# gateway, each stage started only once the one before passes its health check, run here with
# `podman healthcheck run`. podman-compose 1.5 (from PyPI, into deploy/podman/.venv): Debian's
# 1.0.3 knows no profiles, no `healthcheck: {disable: true}` and no depends_on conditions.
# Images: deploy/build-images.sh; where no registry is reachable LLMESH_REDIS_IMAGE defaults to the
# llmesh-redis:bookworm it built from Debian's package.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
COMPOSE_FILE=$ROOT/deploy/docker-compose.yml
PROJECT=llmesh
VENV=${LLMESH_COMPOSE_VENV:-$ROOT/deploy/podman/.venv}
PODMAN_COMPOSE_VERSION=1.5.0
HEALTH_ORDER=(redis kvstore scheduler worker gateway)
HEALTH_TIMEOUT_S=${LLMESH_HEALTH_TIMEOUT_S:-600}

export CONTAINERS_CONF=${CONTAINERS_CONF:-$ROOT/deploy/podman/containers.conf}
if [ -z "${LLMESH_REDIS_IMAGE:-}" ] && ! podman image exists redis:7-alpine \
    && podman image exists localhost/llmesh-redis:bookworm; then
    export LLMESH_REDIS_IMAGE=localhost/llmesh-redis:bookworm
fi

if [ ! -x "$VENV/bin/podman-compose" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "podman-compose==$PODMAN_COMPOSE_VERSION"
fi

compose() { "$VENV/bin/podman-compose" -f "$COMPOSE_FILE" "$@"; }

containers_of() {  # the project's containers of one service (every replica)
    podman ps -a --format '{{.Names}}' \
        --filter "label=com.docker.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.service=$1"
}

wait_healthy() {  # SERVICE...: every container of each passes its health check
    local deadline=$((SECONDS + HEALTH_TIMEOUT_S)) service name
    for service in "$@"; do
        for name in $(containers_of "$service"); do
            until podman healthcheck run "$name" >/dev/null 2>&1; do
                if [ $SECONDS -ge $deadline ]; then
                    echo "$name: not healthy after ${HEALTH_TIMEOUT_S} s" >&2
                    podman logs --tail 30 "$name" >&2 || true
                    return 1
                fi
                sleep 2
            done
            echo "healthy: $name"
        done
    done
}

wait_completed() {  # SERVICE...: the one-shot exited 0
    local service name code
    for service in "$@"; do
        for name in $(containers_of "$service"); do
            code=$(podman wait "$name")
            if [ "$code" != 0 ]; then
                echo "$name exited with $code" >&2
                podman logs --tail 30 "$name" >&2 || true
                return 1
            fi
            echo "completed: $name"
        done
    done
}

leftovers() {  # anything of the project still there, one a line
    podman ps -a --format 'container {{.Names}}' --filter "label=com.docker.compose.project=$PROJECT"
    podman volume ls --format 'volume {{.Name}}' --filter "label=com.docker.compose.project=$PROJECT"
    podman network ls --format 'network {{.Name}}' | grep -E "^network ${PROJECT}_" || true
}

case ${1:-} in
    up)
        shift  # the rest (e.g. --scale worker=2) goes to every stage
        compose up -d --no-deps "$@" secrets convert
        wait_completed secrets convert
        compose up -d --no-deps "$@" redis
        wait_healthy redis
        compose up -d --no-deps "$@" kvstore
        wait_healthy kvstore
        compose up -d --no-deps "$@" scheduler worker
        wait_healthy worker scheduler
        compose up -d --no-deps "$@" gateway
        wait_healthy gateway
        ;;
    wait)
        wait_healthy "${HEALTH_ORDER[@]}"
        ;;
    down)
        shift
        # podman-compose's down knows only the compose file's replicas, not those of --scale: stop
        # every container of the project first (SIGTERM, the services' drain, then the grace).
        mapfile -t names < <(podman ps -a --format '{{.Names}}' --filter "label=com.docker.compose.project=$PROJECT")
        if [ ${#names[@]} -gt 0 ]; then
            podman stop -t 40 "${names[@]}" >/dev/null
            podman rm -f "${names[@]}" >/dev/null
        fi
        compose down -v "$@"
        left=$(leftovers)
        if [ -n "$left" ]; then
            echo "left behind:" >&2
            echo "$left" >&2
            exit 1
        fi
        echo "nothing of $PROJECT left"
        ;;
    *)
        compose "$@"
        ;;
esac
