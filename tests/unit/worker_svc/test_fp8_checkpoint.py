"""FP8 checkpoints in vLLM's formats: written by `llmesh quantize`, loaded straight into the FP8
layers (compressed-tensors, fbgemm_fp8, fp8), and refused with a clear error when malformed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.paged import PagedKV
from worker_svc.loader import load_model
from worker_svc.models.fp8_writer import hf_named_tensors, quantize_checkpoint, write_fp8_checkpoint
from worker_svc.parallel import TensorParallel

BATCH = [("a", [5, 17, 33, 9, 250]), ("b", [101])]


def _logits(model: torch.nn.Module, cfg) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.cat(PagedKV(cfg, num_blocks=8).step(model, BATCH))


@pytest.fixture(scope="module")
def written(tiny_model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The qwen2 tiny model (q|k|v biases) and its FP8 checkpoints in both formats."""
    root = tmp_path_factory.mktemp("fp8_ckpt")
    src = str(shutil.copytree(tiny_model_dirs["qwen2"], root / "src"))
    Path(src, "tokenizer_config.json").write_text("{}")  # stands for the tokenizer files
    out = {"src": src}
    for fmt in ("compressed-tensors", "fbgemm"):
        out[fmt] = str(root / fmt)
        report = quantize_checkpoint(src, out[fmt], fmt, progress=False)
        assert report.quantized == 2 * 7 and report.kept == 0 and report.bytes_out < report.bytes_in
    return out


@pytest.mark.parametrize("fmt", ["compressed-tensors", "fbgemm"])
def test_a_written_checkpoint_loads_into_the_on_the_fly_fp8_model_bit_for_bit(
    written: dict[str, str], fmt: str
) -> None:
    ref, cfg = load_model(written["src"], quantization="fp8")
    config = json.loads(Path(written[fmt], "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == {"fbgemm": "fbgemm_fp8"}.get(fmt, fmt)
    assert Path(written[fmt], "tokenizer_config.json").is_file()
    tensors = load_file(str(Path(written[fmt], "model.safetensors")))
    assert tensors["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.self_attn.k_proj.weight_scale"].shape == (cfg.kv_size, 1)
    assert tensors["lm_head.weight"].dtype == torch.float32  # the head stays as it was
    for quantization in (None, "fp8"):  # found from config.json; the flag agrees with it
        model, _ = load_model(written[fmt], quantization=quantization)
        ours, theirs = dict(model.named_buffers()), dict(ref.named_buffers())
        scale = "layers.1.self_attn.qkv_proj.weight_scale"
        assert ours[scale].shape == (1, cfg.q_size + 2 * cfg.kv_size)
        assert torch.equal(ours[scale], theirs[scale])
        assert not any("scale" in n for n, _ in model.named_parameters())
        torch.testing.assert_close(_logits(model, cfg), _logits(ref, cfg), rtol=0, atol=0)


def test_tensor_parallel_ranks_read_their_slices_of_weights_and_scales(written: dict[str, str]) -> None:
    full, cfg = load_model(written["compressed-tensors"])
    ranks = [load_model(written["compressed-tensors"], tp=TensorParallel(rank=r, size=2))[0] for r in (0, 1)]
    qkv = [dict(m.named_buffers())["layers.0.self_attn.qkv_proj.weight_scale"] for m in ranks]
    ref = dict(full.named_buffers())["layers.0.self_attn.qkv_proj.weight_scale"]
    q, kv = cfg.q_size // 2, cfg.kv_size // 2
    assert torch.equal(torch.cat([s[:, :q] for s in qkv], 1), ref[:, : cfg.q_size])
    assert torch.equal(torch.cat([s[:, q + kv :] for s in qkv], 1), ref[:, cfg.q_size + cfg.kv_size :])
    down = [dict(m.named_buffers())["layers.0.mlp.down_proj.weight_scale"] for m in ranks]
    assert all(
        torch.equal(d, dict(full.named_buffers())["layers.0.mlp.down_proj.weight_scale"]) for d in down
    )
    w = [m.get_parameter("layers.0.mlp.down_proj.weight") for m in ranks]
    assert w[0].dtype == torch.float8_e4m3fn
    assert torch.equal(
        torch.cat(w, 1).view(torch.uint8),
        full.get_parameter("layers.0.mlp.down_proj.weight").view(torch.uint8),
    )


def _rewrite(
    src: str, dst: Path, config_edit: Callable[[dict], None], tensors_edit: Callable[[dict], None]
) -> str:
    """A copy of the checkpoint `src` with its quantization_config and tensors edited."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config_edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(dst / "model.safetensors"))
    tensors_edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def test_per_tensor_scales_static_input_scales_and_ignored_layers(
    written: dict[str, str], tmp_path: Path
) -> None:
    """vLLM's `fp8` method as AutoFP8 writes it: one scale per tensor (here weight_scale_inv),
    static input scales (read, checked, then run as dynamic per-token ones), and a module the
    config keeps unquantized; q, k and v keep their own scales inside the merged layer."""
    plain = load_file(str(Path(written["src"], "model.safetensors")))
    kept = "model.layers.1.mlp.down_proj"

    def config(qc: dict) -> None:
        qc.clear()
        qc.update(quant_method="fp8", activation_scheme="static", ignored_layers=[kept])

    def tensors(t: dict) -> None:
        for name in [n for n in t if n.endswith(".weight_scale")]:
            module = name.removesuffix(".weight_scale")
            del t[name]
            if module == kept:
                t[module + ".weight"] = plain[module + ".weight"]
                continue
            w = plain[module + ".weight"]
            scale = w.abs().amax() / 448
            t[module + ".weight"] = (w / scale).to(torch.float8_e4m3fn)
            t[module + ".weight_scale_inv"] = scale.reshape(1)
            t[module + ".input_scale"] = torch.tensor([0.05])

    path = _rewrite(written["compressed-tensors"], tmp_path / "fp8", config, tensors)
    model, cfg = load_model(path)
    assert model.get_parameter("layers.1.mlp.down_proj.weight").dtype == torch.float32
    qkv = dict(model.named_buffers())["layers.0.self_attn.qkv_proj.weight_scale"][0]
    q_scale = plain["model.layers.0.self_attn.q_proj.weight"].abs().amax() / 448
    k_scale = plain["model.layers.0.self_attn.k_proj.weight"].abs().amax() / 448
    assert torch.equal(qkv[: cfg.q_size], q_scale.expand(cfg.q_size))
    assert torch.equal(qkv[cfg.q_size : cfg.q_size + cfg.kv_size], k_scale.expand(cfg.kv_size))
    unquantized, _ = load_model(written["src"])
    ref = _logits(unquantized, cfg)
    assert ((_logits(model, cfg) - ref).abs().max() / ref.abs().max()) < 0.1


def _drop_scale(t: dict) -> None:
    del t["model.layers.0.mlp.up_proj.weight_scale"]


def _bf16_weight(t: dict) -> None:
    t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16)


def _bad_scale_shape(t: dict) -> None:
    t["model.layers.0.mlp.up_proj.weight_scale"] = t["model.layers.0.mlp.up_proj.weight_scale"][:5]


def _negative_scale(t: dict) -> None:
    t["model.layers.0.mlp.up_proj.weight_scale"] = -t["model.layers.0.mlp.up_proj.weight_scale"]


def _fp8_head(t: dict) -> None:
    t["lm_head.weight"] = t["lm_head.weight"].to(torch.float8_e4m3fn)


def _unknown_method(qc: dict) -> None:
    qc["quant_method"] = "awq"


def _block_wise(qc: dict) -> None:
    qc.clear()
    qc.update(quant_method="fp8", weight_block_size=[128, 128])


def _int_weights(qc: dict) -> None:
    qc["config_groups"]["group_0"]["weights"]["type"] = "int"


def _half_of_a_merged_layer(qc: dict) -> None:
    qc["ignore"].append("model.layers.0.self_attn.q_proj")


@pytest.mark.parametrize(
    "config_edit, tensors_edit, message",
    [
        (None, _drop_scale, r"lacks 1 tensors.*up_proj\.weight_scale"),
        (None, _bf16_weight, r"up_proj\.weight: BF16 .*expected float8_e4m3fn"),
        (None, _bad_scale_shape, r"scale of shape \(5, 1\) for a weight of 128 rows"),
        (None, _negative_scale, r"finite and positive"),
        (None, _fp8_head, r"lm_head\.weight: F8_E4M3"),
        (_unknown_method, None, r"'awq' is not supported.*compressed-tensors, fbgemm_fp8, fp8"),
        (_block_wise, None, r"block-wise FP8"),
        (_int_weights, None, r"weights .* are not supported"),
        (_half_of_a_merged_layer, None, r"all FP8 or all unquantized"),
    ],
)
def test_a_malformed_fp8_checkpoint_is_refused_saying_what_is_wrong(
    written: dict[str, str], tmp_path: Path, config_edit, tensors_edit, message: str
) -> None:
    path = _rewrite(
        written["compressed-tensors"],
        tmp_path / "bad",
        config_edit or (lambda qc: None),
        tensors_edit or (lambda t: None),
    )
    with pytest.raises(ValueError, match=message):
        load_model(path)


def test_dummy_weights_under_an_fp8_config_are_quantized_on_load(written: dict[str, str]) -> None:
    model, _ = load_model(written["fbgemm"], load_format="dummy")
    assert model.get_parameter("layers.0.mlp.down_proj.weight").dtype == torch.float8_e4m3fn


def test_llmesh_quantize_keeps_ignored_modules_and_refuses_a_quantized_source(
    written: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmesh.cli import main

    out = str(tmp_path / "o")
    argv = ["--recipe", "edge-down", "--ignore", "re:.*layers\\.0\\.self_attn\\.o_proj"]
    assert main(["quantize", "--model", written["src"], "--out", out, *argv]) == 0
    assert "11 linear weights in FP8 (compressed-tensors), 3 kept" in capsys.readouterr().out
    model, cfg = load_model(out)
    for kept in ("layers.0.mlp.down_proj", "layers.1.mlp.down_proj", "layers.0.self_attn.o_proj"):
        assert model.get_parameter(kept + ".weight").dtype == torch.float32
    assert model.get_parameter("layers.0.mlp.gate_up_proj.weight").dtype == torch.float8_e4m3fn
    ref = _logits(load_model(written["src"])[0], cfg)  # SiLU·mul hands the kept layer unquantized rows
    assert ((_logits(model, cfg) - ref).abs().max() / ref.abs().max()) < 0.1
    assert main(["quantize", "--model", written["fbgemm"], "--out", str(tmp_path / "again")]) == 1
    assert "already quantized (fbgemm_fp8)" in capsys.readouterr().err
    assert main(["quantize", "--model", written["src"], "--out", out]) == 1
    assert "is not empty" in capsys.readouterr().err


def test_a_model_in_memory_is_written_under_its_hugging_face_names(
    written: dict[str, str], tmp_path: Path
) -> None:
    """What the GPU check writes an 8B-shaped checkpoint from: a model built in memory, its
    merged layers split back into q/k/v and gate/up."""
    model, cfg = load_model(written["src"])
    tensors = dict(hf_named_tensors(model))
    assert sorted(tensors) == sorted(load_file(str(Path(written["src"], "model.safetensors"))))
    config = json.loads(Path(written["src"], "config.json").read_text())
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    write_fp8_checkpoint(
        hf_named_tensors(model), shapes, config, str(tmp_path / "m"), "fbgemm", progress=False
    )
    ref, _ = load_model(written["src"], quantization="fp8")
    loaded, _ = load_model(str(tmp_path / "m"))
    torch.testing.assert_close(_logits(loaded, cfg), _logits(ref, cfg), rtol=0, atol=0)
