"""Generate the gRPC stubs once before any test imports them."""

from services.gen_protos import ensure_stubs

ensure_stubs()
