"""Damaged checkpoints are CheckpointError naming the directory, the file and the tensor (issue [first-contact]
item 8): a missing directory or config.json, a missing, truncated or corrupt shard, an unreadable index, and a
tensor the index lists that its shard does not hold (a raw SafetensorError before)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41.model import DeepseekV41Flash
from dsv41.model.checkpoint import CheckpointError, CheckpointNotFoundError


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_model):
    d = str(tmp_path_factory.mktemp("ckpt"))
    from dsv41.model.checkpoint import save_pretrained
    save_pretrained(tiny_model, d, max_shard_bytes=1 << 20)  # several shards
    return d


def _copy(saved, dst):
    shutil.copytree(saved, dst)
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        wmap = json.load(f)["weight_map"]
    return str(dst), wmap


def _load(path):
    return DeepseekV41Flash.from_pretrained(path, dtype=torch.float32)


def test_a_missing_directory_is_named_as_such(tmp_path):
    gone = str(tmp_path / "no-such-checkpoint")
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint directory '.*no-such-checkpoint' does not exist"):
        _load(gone)
    with pytest.raises(FileNotFoundError):  # what a missing config.json raised before: callers catching it still do
        _load(gone)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"'.*empty' has no config.json"):
        _load(str(tmp_path / "empty"))


def test_a_truncated_shard_names_the_directory_and_the_file(saved, tmp_path):
    path, wmap = _copy(saved, tmp_path / "t")
    shard = sorted(set(wmap.values()))[1]
    full = os.path.join(path, shard)
    data = open(full, "rb").read()
    with open(full, "wb") as f:
        f.write(data[:len(data) // 2])  # an interrupted download
    with pytest.raises(CheckpointError) as e:
        _load(path)
    msg = str(e.value)
    assert path in msg and repr(shard) in msg and "truncated or corrupt" in msg


def test_a_corrupt_shard_names_the_directory_and_the_file(saved, tmp_path):
    path, wmap = _copy(saved, tmp_path / "c")
    shard = sorted(set(wmap.values()))[0]
    with open(os.path.join(path, shard), "wb") as f:
        f.write(b"\xff" * 4096)
    with pytest.raises(CheckpointError, match=rf"{path}.*{shard}.*truncated or corrupt"):
        _load(path)


def test_a_missing_shard_names_the_file(saved, tmp_path):
    path, wmap = _copy(saved, tmp_path / "m")
    shard = sorted(set(wmap.values()))[-1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(CheckpointNotFoundError, match=rf"{path}.*shard '{shard}' does not exist"):
        _load(path)


def test_a_tensor_the_index_lists_but_its_shard_lacks_names_directory_file_and_tensor(saved, tmp_path):
    path, wmap = _copy(saved, tmp_path / "x")
    name = "layers.3.attn.kv_norm.weight"
    shard = wmap[name]
    tensors = load_file(os.path.join(path, shard))
    del tensors[name]
    save_file(tensors, os.path.join(path, shard))  # the index still points there
    with pytest.raises(CheckpointError) as e:
        _load(path)
    msg = str(e.value)
    assert path in msg and repr(shard) in msg and name in msg and "does not contain" in msg


def test_an_unreadable_index_names_the_directory_and_the_index(saved, tmp_path):
    path, _ = _copy(saved, tmp_path / "i")
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match=rf"{path}.*model.safetensors.index.json"):
        _load(path)
