"""Block keys must be equal in every process: the store is shared by processes and machines."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
from scheduler_svc.prefix_hash import extend_block_keys
keys = extend_block_keys([], list(range(1000, 1100)), 16, b"fingerprint")
print(",".join(k.hex() for k in keys))
"""


def _keys_in_a_process(hash_seed: str) -> list[str]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    return out.stdout.strip().split(",")


def test_block_keys_do_not_depend_on_the_process_hash_seed():
    a, b = _keys_in_a_process("1"), _keys_in_a_process("12345")
    assert a == b and len(a) == 100 // 16 and all(len(k) == 64 for k in a)
    from scheduler_svc.prefix_hash import extend_block_keys

    assert extend_block_keys([], list(range(1000, 1100)), 16, b"fingerprint")[0].hex() == a[0]
