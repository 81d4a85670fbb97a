#!/bin/sh
# Makes the mesh's Secret `llmesh-mesh` once per namespace: `internal-key` (every internal RPC of
# every llmesh service) and `redis-password` (Redis's ACL user `llmesh`), 256 random bits each.
# Every pod mounts it as files; no pod starts before it exists. An existing Secret is kept
# (`--rotate` replaces it; then `kubectl -n NS rollout restart deployment` picks the new one up).
#
#   deploy/k8s/make-secret.sh [--rotate] [namespace]     # default namespace: llmesh
#
# The values go through files in a private temporary folder, never through argv.
set -eu

rotate=false
if [ "${1:-}" = "--rotate" ]; then rotate=true; shift; fi
ns=${1:-llmesh}
kubectl=${KUBECTL:-kubectl}

if $kubectl -n "$ns" get secret llmesh-mesh >/dev/null 2>&1; then
    if ! $rotate; then
        echo "secret llmesh-mesh exists in namespace $ns: kept (--rotate replaces it)"
        exit 0
    fi
    $kubectl -n "$ns" delete secret llmesh-mesh
fi
$kubectl get namespace "$ns" >/dev/null 2>&1 || $kubectl create namespace "$ns"

umask 077
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
random_hex() { head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
random_hex > "$dir/internal-key"
random_hex > "$dir/redis-password"
$kubectl -n "$ns" create secret generic llmesh-mesh \
    --from-file=internal-key="$dir/internal-key" --from-file=redis-password="$dir/redis-password"
