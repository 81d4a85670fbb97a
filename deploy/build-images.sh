#!/usr/bin/env bash
# Build llmesh's images (`make images`): llmesh:gateway (gateway, router: no torch, transformers or
# numpy), llmesh:light (scheduler, KV store: no torch), llmesh:cpu (CPU worker, `convert`) and, with
# --cuda, llmesh:cuda (GPU worker); prints the time and size of each.
#
#   deploy/build-images.sh [--cuda] [--no-cache] [--prune] [--only gateway,light,cpu,cuda,redis]
#
# Podman where there is no Docker daemon (apt installs podman, buildah, runc and mmdebstrap when
# missing; CONTAINERS_CONF defaults to deploy/podman/containers.conf: runc, no default ulimits).
# The base is python:3.11-slim-bookworm when a registry answers, else Debian bookworm's python3
# made here with mmdebstrap and imported as localhost/llmesh-base:bookworm. RUN steps use the
# host's network (pip reaches the host's package index) and the host's CA bundle (a TLS-inspecting
# proxy's CA included); CPU torch comes from PyTorch's index, or from a local wheel in
# $LLMESH_WHEELS (default /opt/wheels) when that index is out of reach.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DOCKERFILE=$ROOT/deploy/docker/Dockerfile
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
WHEELS=${LLMESH_WHEELS:-/opt/wheels}
BASE_TAG=localhost/llmesh-base:bookworm
SLIM=docker.io/library/python:3.11-slim-bookworm

targets=(gateway light cpu)
no_cache=()
prune=0
only=0
while [ $# -gt 0 ]; do
    case $1 in
        --cuda) targets+=(cuda) ;;
        --no-cache) no_cache=(--no-cache) ;;
        --prune) prune=1 ;;
        --only) shift; only=1; targets=(); IFS=', ' read -r -a targets <<<"$1" ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done

reachable() {  # any HTTP answer at all means the host is reachable
    local code
    code=$(curl -s -o /dev/null -m 8 -w '%{http_code}' "$1" || true)
    [ "$code" != "000" ]
}

# -- the engine ---------------------------------------------------------------------------------
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    ENGINE=docker
else
    ENGINE=podman
    need=()
    for tool in podman buildah runc mmdebstrap podman-compose; do
        command -v "$tool" >/dev/null || need+=("$tool")
    done
    if [ ${#need[@]} -gt 0 ]; then
        echo "== apt-get install ${need[*]}"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
    fi
    export CONTAINERS_CONF=${CONTAINERS_CONF:-$ROOT/deploy/podman/containers.conf}
fi

# -- the base -----------------------------------------------------------------------------------
if reachable https://registry-1.docker.io/v2/ && $ENGINE pull -q "$SLIM" >/dev/null; then
    BASE=$SLIM
elif [ "$ENGINE" = podman ]; then
    BASE=$BASE_TAG
    if ! podman image exists "$BASE" || [ ${#no_cache[@]} -gt 0 ]; then
        echo "== no registry: making $BASE from Debian packages (mmdebstrap)"
        start=$SECONDS
        tarball=$(mktemp --suffix=.tar)
        # merged-usr hook instead of the usrmerge package (which pulls perl: 45 MB); no docs,
        # man pages or translations.
        mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
            --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
            --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
            --dpkgopt='path-exclude=/usr/share/locale/*' \
            bookworm "$tarball" \
            "deb http://deb.debian.org/debian bookworm main" \
            "deb http://deb.debian.org/debian bookworm-updates main" \
            "deb http://deb.debian.org/debian-security bookworm-security main"
        podman import --change 'CMD ["/bin/bash"]' "$tarball" "$BASE" >/dev/null
        rm -f "$tarball"
        echo "   base made in $((SECONDS - start)) s"
    fi
else
    echo "no registry reachable and no podman: cannot make a base image" >&2
    exit 1
fi

# -- where pip finds torch ----------------------------------------------------------------------
build_args=(--build-arg "PYTHON_IMAGE=$BASE" --build-arg "TORCH_VERSION=$TORCH_VERSION")
run_opts=()
if [ "$ENGINE" = podman ]; then
    # HEALTHCHECK is a Docker-format field (OCI images drop it).
    run_opts+=(--format docker --network host)
    [ -f /etc/ssl/certs/ca-certificates.crt ] \
        && run_opts+=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
fi
if ! reachable https://download.pytorch.org/whl/cpu/; then
    if ls "$WHEELS"/torch-"$TORCH_VERSION"+cpu-*.whl >/dev/null 2>&1 && [ "$ENGINE" = podman ]; then
        run_opts+=(-v "$WHEELS:/wheels:ro")
        build_args+=(--build-arg TORCH_FIND_LINKS=/wheels)
    elif [[ " ${targets[*]} " == *" cpu "* ]]; then
        echo "download.pytorch.org is out of reach and $WHEELS has no torch-$TORCH_VERSION+cpu wheel" >&2
        exit 1
    fi
    build_args+=(--build-arg TORCH_CUDA_INDEX=https://pypi.org/simple)  # PyPI's Linux torch is CUDA
fi

# -- the images ---------------------------------------------------------------------------------
# Redis too where no registry gives one (compose's LLMESH_REDIS_IMAGE).
if [ "$only" = 0 ] && [ "$BASE" = "$BASE_TAG" ] && ! $ENGINE image inspect redis:7-alpine >/dev/null 2>&1; then
    targets+=(redis)
fi
tag_of() { if [ "$1" = redis ]; then echo llmesh-redis:bookworm; else echo "llmesh:$1"; fi; }

declare -A seconds
cd "$ROOT"
for target in "${targets[@]}"; do
    tag=$(tag_of "$target")
    echo "== $tag"
    old_id=$($ENGINE image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
    start=$SECONDS
    $ENGINE build "${no_cache[@]}" "${run_opts[@]}" "${build_args[@]}" \
        -f "$DOCKERFILE" --target "$target" -t "$tag" .
    seconds[$target]=$((SECONDS - start))
    # The image this build replaced is left untagged: remove it (not the build cache, which is the
    # untagged layers of every stage; --prune drops that too).
    new_id=$($ENGINE image inspect --format '{{.Id}}' "$tag")
    if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ]; then
        $ENGINE rmi "$old_id" >/dev/null 2>&1 || true
    fi
done

# The torch-free images serve several services each; a tag per service lets each be rolled alone.
gateway_services=(gateway)
light_services=(scheduler kvstore)
if [[ " ${targets[*]} " == *" gateway "* ]]; then
    # The router (router_svc, `llmesh router`) joins the gateway where the tree carries it.
    $ENGINE run --rm --no-healthcheck --entrypoint python llmesh:gateway -c "import router_svc.service" >/dev/null 2>&1 \
        && gateway_services+=(router)
    for service in "${gateway_services[@]:1}"; do $ENGINE tag llmesh:gateway "llmesh:$service"; done
fi
if [[ " ${targets[*]} " == *" light "* ]]; then
    for service in "${light_services[@]}"; do $ENGINE tag llmesh:light "llmesh:$service"; done
fi

if [ "$prune" = 1 ]; then $ENGINE image prune -f >/dev/null; fi  # every dangling image: the cache too

echo
printf '%-22s %10s %10s  %s\n' image "build (s)" "size (MB)" "services"
for target in "${targets[@]}"; do
    bytes=$($ENGINE image inspect --format '{{.Size}}' "$(tag_of "$target")")
    case $target in
        gateway) services="${gateway_services[*]}" ;;
        light) services="${light_services[*]} (and the gateway, router)" ;;
        redis) services="redis (and the one-shot secrets)" ;;
        *) services="worker convert (and every other service)" ;;
    esac
    printf '%-22s %10s %10s  %s\n' "$(tag_of "$target")" "${seconds[$target]}" "$((bytes / 1000000))" "$services"
done
echo "base: $BASE ($(( $($ENGINE image inspect --format '{{.Size}}' "$BASE") / 1000000 )) MB)"
