"""Split GGUF models (``-00001-of-00003.gguf``, the ``split.*`` keys), written by gguf-py's own splitting
writer (the oracle's layout): they load as one model, and each broken split is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

import plinth
from plinth.cli import main
from plinth.gguf import GGUFError, SplitGGUF, open_gguf
from plinth.gguf.split import part_path
from plinth.testing import byte_vocab, tiny_metadata, write_synthetic_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture
def registry(plinth_registry):
    from plinth_llama.plugin import plugin

    return plinth_registry(plugin)


@pytest.fixture
def whole(tmp_path, registry):
    md = tiny_metadata("llama", n_vocab=257, n_layer=3) | byte_vocab()
    return write_synthetic_gguf(tmp_path / "whole.gguf", "llama", md, registry, seed=7)


def resplit(src, out_dir, max_tensors, keys=None):
    """``src`` rewritten by gguf-py's GGUFWriter with ``split_max_tensors``: its parts, first first."""
    r = gguf.GGUFReader(src)
    out_dir.mkdir(exist_ok=True)
    w = gguf.GGUFWriter(out_dir / "model.gguf", r.fields["general.architecture"].contents(),
                        split_max_tensors=max_tensors)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(name, value, vtype)
    for key, (value, vtype) in (keys or {}).items():
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(out_dir.glob("model-*-of-*.gguf"))


def test_split_model_loads_as_the_whole(whole, registry, tmp_path):
    parts = resplit(whole, tmp_path / "split", max_tensors=10)
    assert len(parts) >= 3 and parts[0].name.endswith("-00001-of-%05d.gguf" % len(parts))
    gf = open_gguf(parts[0])
    assert isinstance(gf, SplitGGUF) and len(gf.parts) == len(parts)
    tokens = [5, 80, 17, 200, 3]
    one = plinth.load_model(whole, registry=registry).logits(tokens)
    split = plinth.load_model(parts[0], registry=registry)
    assert np.array_equal(split.logits(tokens), one)
    for name, info in gf.tensors.items():
        assert np.array_equal(gf.raw(name), open_gguf(whole).raw(name))


def test_plain_file_stays_plain(whole):
    assert not isinstance(open_gguf(whole), SplitGGUF)


def test_info_shows_the_parts(whole, tmp_path, capsys):
    parts = resplit(whole, tmp_path / "split", max_tensors=12)
    assert main(["--plugins", "llama", "info", "-m", str(parts[0])]) == 0
    out = capsys.readouterr().out
    assert f"parts:        {len(parts)} (a split model)" in out
    for p in parts:
        assert p.name in out


def test_later_part_names_the_first(whole, tmp_path):
    parts = resplit(whole, tmp_path / "split", max_tensors=10)
    with pytest.raises(GGUFError, match=f"part 2 of a {len(parts)}-part split model; open the first part, "
                                        f"{parts[0].name}"):
        open_gguf(parts[1])


def test_missing_part_is_named(whole, tmp_path, registry):
    parts = resplit(whole, tmp_path / "split", max_tensors=10)
    parts[-1].unlink()
    with pytest.raises(GGUFError, match=f"part {len(parts)} of this {len(parts)}-part split model, "
                                        f"{parts[-1].name}, is missing"):
        plinth.load_model(parts[0], registry=registry)


def test_mixed_splits_are_refused(whole, tmp_path):
    a = resplit(whole, tmp_path / "a", max_tensors=10)
    b = resplit(whole, tmp_path / "b", max_tensors=20)
    stray = part_path(a[0], 1, len(a))
    stray.write_bytes(b[1].read_bytes())  # a part of another split under this split's name
    with pytest.raises(GGUFError, match="split.count|split.no|also in"):
        open_gguf(a[0])


def test_wrong_tensor_count_is_refused(whole, tmp_path):
    parts = resplit(whole, tmp_path / "split", max_tensors=10)
    n = len(open_gguf(parts[0]).tensors)
    r = gguf.GGUFReader(parts[0], "r+")  # gguf-py edits a value in place
    r.fields["split.tensors.count"].parts[-1][0] = n + 1
    r.data.flush()
    del r
    with pytest.raises(GGUFError, match=f"'split.tensors.count' = {n + 1}, but the {len(parts)} parts hold {n}"):
        open_gguf(parts[0])


def test_part_names_follow_llama_cpp():
    from pathlib import Path

    assert part_path(Path("/m/x-00001-of-00003.gguf"), 2, 3) == Path("/m/x-00003-of-00003.gguf")
    assert part_path(Path("/m/x.gguf"), 0, 2) == Path("/m/x-00001-of-00002.gguf")
