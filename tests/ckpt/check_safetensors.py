#!/usr/bin/env python3
"""Checks a Ferry checkpoint with the standard Python `safetensors` library.

How to run (python3 with numpy and safetensors; torch as well when the checkpoint holds BF16
tensors, since numpy has no bfloat16). Not run by ctest.

  # 1. Have the C++ test leave a checkpoint behind (step 42; the directory must be empty or missing):
  FERRY_CKPT_SAMPLE_DIR=/tmp/ferry_sample build/tests/ckpt_checkpoint_test \
      --gtest_filter='*RoundTripAllDtypesAndShapes*'
  # 2. Check it (a checkpoint directory, or a root whose `latest` is followed):
  python3 tests/ckpt/check_safetensors.py /tmp/ferry_sample/step-00000042

For every tensor in manifest.json, the library must load it with the manifest's dtype and shape, and
the bytes it returns must equal the bytes at the manifest's file_offset, read directly from the file.
The file's metadata must equal the manifest's. If the optional `xxhash` module is installed, the
manifest's checksums are verified too. Exit status 0 when everything agrees, 1 otherwise.
"""

import json
import os
import sys

import numpy as np
import safetensors.numpy
from safetensors import safe_open

RANK_FILE = "rank-00000.safetensors"
NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16}


def resolve(path):
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    with open(os.path.join(path, "latest")) as f:
        return os.path.join(path, f.read().strip())


def load_with_library(path, manifest_tensors):
    """name -> (dtype name, shape tuple, bytes) as the safetensors library sees the file."""
    out = {}
    has_bf16 = any(t["dtype"] == "BF16" for t in manifest_tensors)
    if not has_bf16:
        arrays = safetensors.numpy.load_file(path)
    else:
        # load_file would stop at the first BF16 tensor: take the others one by one through numpy.
        arrays = {}
        with safe_open(path, framework="np") as f:
            for t in manifest_tensors:
                if t["dtype"] != "BF16":
                    arrays[t["name"]] = f.get_tensor(t["name"])
        import torch
        import safetensors.torch
        for name, tensor in safetensors.torch.load_file(path).items():
            if tensor.dtype == torch.bfloat16:
                raw = tensor.contiguous().view(torch.int16).numpy().tobytes()
                out[name] = ("BF16", tuple(tensor.shape), raw)
    numpy_names = {np.dtype(v): k for k, v in NUMPY_DTYPES.items()}
    for name, array in arrays.items():
        dtype = numpy_names.get(array.dtype, str(array.dtype))
        little_endian = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        out[name] = (dtype, tuple(array.shape), little_endian.tobytes())
    return out


def main(argv):
    if len(argv) != 2:
        print(__doc__)
        return 2
    ckpt = resolve(argv[1])
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    path = os.path.join(ckpt, RANK_FILE)
    with open(path, "rb") as f:
        file_bytes = f.read()
    try:
        import xxhash
    except ImportError:
        xxhash = None

    errors = []
    with safe_open(path, framework="np") as f:
        if (f.metadata() or {}) != manifest["metadata"]:
            errors.append(f"metadata differs: file {f.metadata()!r}, manifest {manifest['metadata']!r}")
        keys = set(f.keys())
    names = {t["name"] for t in manifest["tensors"]}
    if keys != names:
        errors.append(f"tensor names differ: only in file {sorted(keys - names)}, "
                      f"only in manifest {sorted(names - keys)}")

    loaded = load_with_library(path, manifest["tensors"])
    for t in manifest["tensors"]:
        name = t["name"]
        if name not in loaded:
            errors.append(f"{name}: not loaded by the library")
            continue
        dtype, shape, data = loaded[name]
        (chunk,) = t["chunks"]
        raw = file_bytes[chunk["file_offset"]:chunk["file_offset"] + t["bytes"]]
        if dtype != t["dtype"]:
            errors.append(f"{name}: library dtype {dtype}, manifest {t['dtype']}")
        if shape != tuple(t["shape"]):
            errors.append(f"{name}: library shape {shape}, manifest {tuple(t['shape'])}")
        if len(raw) != t["bytes"] or data != raw:
            errors.append(f"{name}: library bytes differ from the bytes at file_offset "
                          f"{chunk['file_offset']}")
        if xxhash is not None:
            found = "xxh3:" + xxhash.xxh3_64_hexdigest(raw)
            if found != chunk["checksum"]:
                errors.append(f"{name}: checksum {found}, manifest {chunk['checksum']}")

    for e in errors:
        print("FAIL", e)
    checked = "checksums verified" if xxhash is not None else "checksums not verified (no xxhash module)"
    print(f"{ckpt}: {len(manifest['tensors'])} tensors, {len(errors)} problems; {checked}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
