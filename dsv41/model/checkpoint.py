"""Checkpoint I/O in the V4.1 layout: `config.json` + safetensors shards named as in MODEL.md §2.13.

Storage dtypes in the files follow the published checkpoint: dense projections FP8 E4M3
(`float8_e4m3fn`) with UE8M0 block scales (`float8_e8m0fnu`, grid [N/32, K/32]); routed experts FP4
E2M1 packed two per byte (`float4_e2m1fn_x2`, [N, K/2]) with UE8M0 scales [N, K/32], one tensor per
expert (`ffn.experts.{e}.w1.weight`); `attn.wo_a` FP8 (dequantised to the model dtype at load, as the
reference's conversion does); norms, embeddings and the head in the model dtype; mHC, sinks and router
biases FP32. In memory dsv41 keeps every low-precision tensor as `uint8` bytes (see `formats`).

A `bf16`-mode model loads an FP8/FP4 checkpoint by dequantising each tensor once, and saves dense
tensors (no scales). Loading a dense tensor into a `checkpoint`-mode model is an error.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterator, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from ..ref.formats import dequantize_fp4_1x32, dequantize_fp8_block, quantize_fp8_block

__all__ = ["save_pretrained", "from_pretrained", "CheckpointError", "CheckpointNotFoundError"]

_INDEX = "model.safetensors.index.json"
_E4M3, _E8M0, _FP4 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the model: a missing directory, config or shard, a truncated or corrupt
    shard, missing, extra or mis-shaped tensors. The message names the checkpoint directory, the file and the
    tensor where they apply."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory, its `config.json` or a shard the index lists does not exist (also a
    FileNotFoundError, which `from_pretrained` raised for a missing `config.json` before)."""


def _file_tensors(model) -> Iterator[Tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor in file dtype) for every weight of `model`."""
    sd = model.state_dict()
    for name, t in sd.items():
        if ".ffn.experts.w" in name:
            prefix, leaf = name.rsplit(".experts.", 1)
            proj = leaf.split("_")[0]
            kind = "scale" if leaf.endswith("_scale") else "weight"
            for e in range(t.shape[0]):
                yield f"{prefix}.experts.{e}.{proj}.{kind}", _to_file(t[e], kind, fp4=True)
        elif name.endswith("attn.wo_a.weight") and model.weight_mode == "checkpoint":
            q, s = quantize_fp8_block(t.float())
            yield name, q.view(_E4M3)
            yield name[:-len("weight")] + "scale", s.view(_E8M0)
        elif t.dtype == torch.uint8:
            kind = "scale" if name.endswith(".scale") else "weight"
            yield name, _to_file(t, kind, fp4=False)
        else:
            yield name, t


def _to_file(t: torch.Tensor, kind: str, fp4: bool) -> torch.Tensor:
    if t.dtype != torch.uint8:
        return t
    if kind == "scale":
        return t.view(_E8M0)
    return t.view(_FP4) if fp4 else t.view(_E4M3)


def save_pretrained(model, path: str, max_shard_bytes: int = 4 << 30) -> None:
    """Write `config.json`, safetensors shards and `model.safetensors.index.json` into directory `path`.

    Tensors are moved to CPU shard by shard; shards hold at most `max_shard_bytes` (default 4 GiB).
    """
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    shards, cur, size = [], {}, 0
    for name, t in _file_tensors(model):
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t.detach().contiguous().cpu()
        size += nbytes
    if cur:
        shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fn))
        weight_map.update({k: fn for k in shard})
    with open(os.path.join(path, _INDEX), "w") as f:
        json.dump({"metadata": {"format": "dsv41"}, "weight_map": weight_map}, f, indent=1)


def _corrupt(path: str, fn: str, e: Exception) -> CheckpointError:
    """The error for a shard safetensors cannot read (truncated download, overwritten file)."""
    return CheckpointError(f"checkpoint {path!r}: shard {fn!r} is truncated or corrupt, so it cannot be read "
                           f"(safetensors: {e}); download or save it again")


def _open_shard(path: str, fn: str):
    """`safe_open` of shard `fn` of checkpoint `path`. Raises CheckpointNotFoundError (missing file) or
    CheckpointError (a header safetensors cannot parse), both naming the directory and the file."""
    from safetensors import SafetensorError

    full = os.path.join(path, fn)
    if not os.path.isfile(full):
        raise CheckpointNotFoundError(f"checkpoint {path!r}: shard {fn!r} does not exist")
    try:
        return safe_open(full, "pt")
    except SafetensorError as e:
        raise _corrupt(path, fn, e) from None


def _open_files(path: str) -> Dict[str, str]:
    """{tensor name: shard file} from the index, or from the headers of every shard when there is no index.
    Raises CheckpointError (naming the directory and file) for an unreadable index or shard, or no shards."""
    idx = os.path.join(path, _INDEX)
    if os.path.exists(idx):
        try:
            with open(idx) as f:
                wmap = json.load(f)["weight_map"]
            if not isinstance(wmap, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"checkpoint {path!r}: index {_INDEX!r} is not a safetensors index "
                                  f"({type(e).__name__}: {e})") from None
        return wmap
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {path!r}")
    out = {}
    for fn in files:
        with _open_shard(path, fn) as f:
            out.update({k: fn for k in f.keys()})
    return out


def _check_shards(path: str, wmap: Dict[str, str]) -> None:
    """Open every shard the map names and check it holds the tensors the map puts there, before any is read.
    Raises CheckpointNotFoundError / CheckpointError naming the directory, the file and the missing tensors."""
    by_file: Dict[str, list] = {}
    for k, fn in wmap.items():
        by_file.setdefault(fn, []).append(k)
    for fn in sorted(by_file):
        with _open_shard(path, fn) as f:
            have = set(f.keys())
        missing = sorted(k for k in by_file[fn] if k not in have)
        if missing:
            raise CheckpointError(f"checkpoint {path!r}: shard {fn!r} does not contain {len(missing)} tensor(s) its "
                                  f"index {_INDEX!r} lists there, first: {missing[:5]}")


@torch.no_grad()
def from_pretrained(model_cls, path: str, weight_mode: str = "checkpoint", dtype: torch.dtype = torch.bfloat16,
                    device=None, token_map: torch.Tensor | None = None):
    """Build a `model_cls` (`DeepseekV41Flash`, whose `from_pretrained` passes itself: this module does not import
    the model back) from checkpoint directory `path`.

    Raises:
        CheckpointNotFoundError (a CheckpointError and a FileNotFoundError): `path` is not a directory, it has no
        config.json, or a shard the index lists is missing. CheckpointError: an unreadable index, a truncated or
        corrupt shard, a tensor the index lists that its shard does not hold, a tensor missing from the files, a
        tensor the model does not have, a shape that differs (message names the tensor and both shapes), or a
        dense tensor where the checkpoint-mode model expects FP8/FP4 bytes. Every message names the directory or
        the tensor, and the file where one applies.
    """
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise CheckpointNotFoundError(f"checkpoint directory {path!r} {what}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointNotFoundError(f"checkpoint {path!r} has no config.json (not a checkpoint directory, or an "
                                      "incomplete download)")
    try:
        config = ModelConfig.from_pretrained(path)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path!r}: config.json does not describe a model: {e}") from None
    # The files first: a truncated shard of a large checkpoint fails in seconds, not after the model is allocated.
    wmap = _open_files(path)
    _check_shards(path, wmap)
    model = model_cls(config, weight_mode=weight_mode, dtype=dtype, device=device, token_map=token_map)
    sd = model.state_dict()
    expected = {}   # checkpoint name -> (state-dict name, expert index or None, kind)
    for name, t in sd.items():
        if ".ffn.experts.w" in name:
            prefix, leaf = name.rsplit(".experts.", 1)
            proj = leaf.split("_")[0]
            kind = "scale" if leaf.endswith("_scale") else "weight"
            for e in range(t.shape[0]):
                expected[f"{prefix}.experts.{e}.{proj}.{kind}"] = (name, e, kind)
        elif name.endswith("attn.wo_a.weight"):
            expected[name] = (name, None, "wo_a")
        else:
            expected[name] = (name, None, "plain")
    wo_a_scales = {k[:-len("weight")] + "scale" for k, v in expected.items() if v[2] == "wo_a"}
    missing = sorted(k for k in expected if k not in wmap)
    # A dense (bf16-mode) model has no scale parameters: the file's scales are consumed by dequantisation.
    consumed = {k for k in wmap if k.endswith(".scale") and k[:-len("scale")] + "weight" in expected}
    extra = sorted(k for k in wmap if k not in expected and k not in wo_a_scales and k not in consumed)
    if missing:
        raise CheckpointError(f"checkpoint {path!r} is missing {len(missing)} tensor(s), first: {missing[:5]}")
    if extra:
        raise CheckpointError(f"checkpoint {path!r} has {len(extra)} tensor(s) the model does not know, "
                              f"first: {extra[:5]}")
    handles = {}
    try:
        def read(key):
            """Tensor `key` from its shard (CheckpointError naming the tensor and file if its bytes are bad)."""
            from safetensors import SafetensorError

            fn = wmap[key]
            if fn not in handles:
                handles[fn] = _open_shard(path, fn)
            try:
                return handles[fn].get_tensor(key)
            except SafetensorError as e:
                raise CheckpointError(f"checkpoint {path!r}: tensor {key!r} in shard {fn!r} cannot be read "
                                      f"(safetensors: {e})") from None

        for key, (name, e, kind) in expected.items():
            src = read(key)
            dst = sd[name] if e is None else sd[name][e]
            if kind == "wo_a":
                if src.dtype == _E4M3:
                    s = read(key[:-len("weight")] + "scale")
                    src = dequantize_fp8_block(src.view(torch.uint8), s.view(torch.uint8), torch.float32)
                _copy_checked(key, dst, src, f"shard {wmap[key]!r} of {path!r}")
                continue
            if src.dtype in (_E4M3, _E8M0, _FP4):
                src = src.view(torch.uint8)
                if dst.dtype != torch.uint8:
                    src = _dequantize_for_dense(key, src, read, dst)
            elif dst.dtype == torch.uint8:
                raise CheckpointError(f"tensor {key!r} (shard {wmap[key]!r} of {path!r}): file holds dense "
                                      f"{src.dtype} {tuple(src.shape)} but the {weight_mode}-mode model stores "
                                      f"FP8/FP4 bytes {tuple(dst.shape)}")
            _copy_checked(key, dst, src, f"shard {wmap[key]!r} of {path!r}")
    finally:
        handles.clear()
    return model.eval()


def _dequantize_for_dense(key: str, codes: torch.Tensor, read, dst: torch.Tensor) -> torch.Tensor:
    if key.endswith(".scale"):
        return codes
    scale = read(key[:-len("weight")] + "scale").view(torch.uint8)
    if codes.shape[-1] * 2 == dst.shape[-1] and ".experts." in key:
        return dequantize_fp4_1x32(codes, scale, torch.float32)
    if key.endswith("embed.weight"):
        from ..ref.formats import dequantize_fp8_1x32
        return dequantize_fp8_1x32(codes, scale, torch.float32)
    return dequantize_fp8_block(codes, scale, torch.float32)


def _copy_checked(key: str, dst: torch.Tensor, src: torch.Tensor, where: str = "") -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise CheckpointError(f"tensor {key!r}{f' ({where})' if where else ''}: checkpoint shape {tuple(src.shape)} "
                              f"!= model shape {tuple(dst.shape)}")
    dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
