"""plinth.testing.write_safetensors writes what plinth.convert.SafetensorsDir (and the format) reads back."""

import json
import struct

import numpy as np

from plinth.convert import SafetensorsDir
from plinth.testing import write_safetensors


def test_round_trip(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    ids = np.array([5, -1, 2**40], dtype=np.int64)
    write_safetensors(tmp_path / "model.safetensors", {"w": a, "d2t": ids, "h": np.ones(2, np.float64)})
    st = SafetensorsDir(tmp_path)
    np.testing.assert_array_equal(st.get("w"), a)
    np.testing.assert_array_equal(st.get("d2t", None), ids)
    assert st.get("h", None).dtype == np.float32  # other float types are written as F32
    raw = (tmp_path / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and json.loads(raw[8:8 + n])["d2t"]["dtype"] == "I64"
