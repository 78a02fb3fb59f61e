"""Checkpoint round trips and named errors (MODEL.md §2.13)."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv41.model import DeepseekV41Flash, ModelConfig
from dsv41.model.checkpoint import CheckpointError


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_model):
    d = str(tmp_path_factory.mktemp("ckpt"))
    tiny_model.save_pretrained(d)
    return d


def _logits(m, ids):
    m.setup_cache(1, 32)
    with torch.no_grad():
        return m(ids, torch.arange(ids.shape[1])[None])


def test_round_trip_gives_identical_logits(saved, tiny_model, tiny_prompt):
    loaded = DeepseekV41Flash.from_pretrained(saved, dtype=torch.float32)
    ids = tiny_prompt[:, :20]
    assert torch.equal(_logits(loaded, ids), _logits(tiny_model, ids))


def test_files_use_the_published_names_and_dtypes(saved):
    with open(os.path.join(saved, "model.safetensors.index.json")) as f:
        names = json.load(f)["weight_map"]
    fn = os.path.join(saved, names["layers.2.attn.wq_b.weight"])
    with safe_open(fn, "pt") as f:
        assert f.get_tensor("layers.2.attn.wq_b.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("layers.2.attn.wq_b.scale").dtype == torch.float8_e8m0fnu
    for key in ("layers.2.ffn.experts.7.w1.weight", "layers.2.ffn.experts.0.w2.scale", "layers.2.attn.wo_a.scale",
                "layers.2.attn.compressor.wgate.weight", "layers.4.attn.indexer.wk.weight",
                "layers.6.attn.indexer.wq_b.weight", "layers.1.engram.embed.scale", "embed.weight", "head.weight"):
        assert key in names, key
    assert "layers.4.attn.compressor.wgate.weight" not in names      # ratio-1 source has no gate
    assert "layers.6.attn.indexer.wk.weight" not in names            # Reindex layers own no keys
    fp4 = load_file(os.path.join(saved, names["layers.2.ffn.experts.7.w1.weight"]))["layers.2.ffn.experts.7.w1.weight"]
    assert fp4.dtype == torch.float4_e2m1fn_x2 and tuple(fp4.shape) == (64, 64)


def test_bf16_mode_loads_checkpoint_by_dequantising(saved, tiny_model, tiny_prompt):
    dense = DeepseekV41Flash.from_pretrained(saved, weight_mode="bf16", dtype=torch.float32)
    w = tiny_model.layers[3].attn.wq_b.dequantized_weight(torch.float32)
    assert torch.equal(dense.layers[3].attn.wq_b.weight, w)


def _corrupt(src, dst, fn):
    import shutil
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        idx = json.load(f)
    files = sorted(set(idx["weight_map"].values()))
    path = os.path.join(dst, files[0])
    tensors = load_file(path)
    fn(tensors, idx)
    save_file(tensors, path)
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if k in tensors or v != files[0]}
    idx["weight_map"].update({k: files[0] for k in tensors})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump(idx, f)


def test_missing_extra_and_misshaped_tensors_are_named(saved, tmp_path):
    _corrupt(saved, tmp_path / "a", lambda t, i: t.pop("layers.3.attn.kv_norm.weight"))
    with pytest.raises(CheckpointError, match="layers.3.attn.kv_norm.weight"):
        DeepseekV41Flash.from_pretrained(str(tmp_path / "a"), dtype=torch.float32)
    _corrupt(saved, tmp_path / "b", lambda t, i: t.__setitem__("layers.3.attn.bogus", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="layers.3.attn.bogus"):
        DeepseekV41Flash.from_pretrained(str(tmp_path / "b"), dtype=torch.float32)
    _corrupt(saved, tmp_path / "c", lambda t, i: t.__setitem__("layers.3.attn.kv_norm.weight", torch.zeros(65)))
    with pytest.raises(CheckpointError, match=r"layers.3.attn.kv_norm.weight.*\(65,\).*\(64,\)"):
        DeepseekV41Flash.from_pretrained(str(tmp_path / "c"), dtype=torch.float32)
