"""Nothing silent: a file whose tensors or architecture keys the architecture does not read is refused
by name (a rope table, a bias or an expert layout dropped would give fluent, wrong text), unless the
user asks for it with --allow-unused / PLINTH_ALLOW_UNUSED=1 / allow_unused=True. Integer tensors
load as integers where a spec allows their type."""

from __future__ import annotations

import numpy as np
import pytest

import plinth
from plinth.cli import main
from plinth.graph import Architecture, BaseGraph, KeyReader, TensorSpec
from plinth.tensors import KeyUse, UnusedError
from plinth.testing import byte_vocab, random_tensors, tiny_metadata, write_gguf, write_synthetic_gguf
from plinth.testing.synthetic import synthetic_specs

gguf = pytest.importorskip("gguf")


@pytest.fixture
def registry(plinth_registry):
    from plinth_llama.plugin import plugin

    return plinth_registry(plugin)


def _with_extras(path, registry, *, tensors=(), keys=()):
    md = tiny_metadata("llama", n_vocab=257) | byte_vocab()
    md.update(dict(keys))
    hp = registry.arch_hparams("llama", md, str(path))
    ts = random_tensors(synthetic_specs(registry, "llama", hp), seed=3)
    for name, shape in tensors:
        ts[name] = np.full(shape, 0.5, dtype=np.float32)
    return write_gguf(path, md, ts)


def test_an_unread_tensor_is_refused_by_name(tmp_path, registry):
    path = _with_extras(tmp_path / "m.gguf", registry, tensors=[("blk.1.attn_mystery.weight", (64,))])
    with pytest.raises(UnusedError, match=r"m\.gguf: the llama architecture \(plugin llama\) does not read "
                                          r"1 tensor\(s\) \(blk\.1\.attn_mystery\.weight\) of this file.*"
                                          r"--allow-unused"):
        plinth.load_model(path, registry=registry)


def test_an_unread_key_is_refused_by_name(tmp_path, registry):
    path = _with_extras(tmp_path / "m.gguf", registry, keys=[("llama.rope.mystery_factor", 4.0)])
    with pytest.raises(UnusedError, match=r"does not read 1 key\(s\) \(llama\.rope\.mystery_factor\)"):
        plinth.load_model(path, registry=registry)


def test_both_are_listed_in_one_line(tmp_path, registry):
    extra = [(f"blk.0.extra{i}.weight", (4,)) for i in range(10)]
    path = _with_extras(tmp_path / "m.gguf", registry, tensors=extra, keys=[("llama.zzz", 1)])
    with pytest.raises(UnusedError) as err:
        plinth.load_model(path, registry=registry)
    text = str(err.value)
    assert "\n" not in text and "10 tensor(s)" in text and "and 2 more" in text and "1 key(s) (llama.zzz)" in text


def test_allow_unused_loads_and_lists_them(tmp_path, registry, monkeypatch):
    path = _with_extras(tmp_path / "m.gguf", registry, tensors=[("blk.0.extra.weight", (4,))],
                        keys=[("llama.extra_key", 2)])
    m = plinth.load_model(path, registry=registry, allow_unused=True)
    assert m.stats.unused == ["blk.0.extra.weight"] and m.stats.unused_keys == ["llama.extra_key"]
    monkeypatch.setenv("PLINTH_ALLOW_UNUSED", "1")
    assert plinth.load_model(path, registry=registry).stats.unused == ["blk.0.extra.weight"]
    monkeypatch.setenv("PLINTH_ALLOW_UNUSED", "yes")
    with pytest.raises(plinth.UserError, match="PLINTH_ALLOW_UNUSED='yes'"):
        plinth.load_model(path, registry=registry)


def test_the_cli_refuses_and_allows(tmp_path, registry, capsys, monkeypatch):
    monkeypatch.setenv("PLINTH_ALLOW_UNUSED", "0")  # recorded, so the flag's setting is undone after the test
    path = _with_extras(tmp_path / "m.gguf", registry, tensors=[("rope_freqs_mystery.weight", (8,))])
    assert main(["--plugins", "llama", "generate", "-m", str(path), "-n", "2", "hi"]) != 0
    err = capsys.readouterr().err
    assert "does not read 1 tensor(s) (rope_freqs_mystery.weight)" in err and "Traceback" not in err
    assert main(["--plugins", "llama", "--allow-unused", "generate", "-m", str(path), "-n", "2", "hi"]) == 0


def test_a_clean_file_has_nothing_unused(tmp_path, registry):
    md = tiny_metadata("llama", n_vocab=257) | byte_vocab()
    m = plinth.load_model(write_synthetic_gguf(tmp_path / "m.gguf", "llama", md, registry), registry=registry)
    assert m.stats.unused == [] and m.stats.unused_keys == []


def test_key_use_records_reads_and_bulk_walks():
    ku = KeyUse({"a.x": 1, "a.y": 2, "a.z": 3, "general.name": "n"})
    assert ku["a.x"] == 1 and ku.get("a.q") is None and "a.y" in ku
    assert ku.unread("a.") == ["a.z"]
    dict(ku)  # a plugin that copies its metadata has read all of it
    assert ku.unread("a.") == []


# ---- integer tensors: an index table kept as integers where the spec allows the type


class _Table(Architecture):
    name = "tabled"

    def hparams(self, r: KeyReader):
        import attrs

        @attrs.frozen
        class HP:
            n_layer: int
            n_vocab: int
            n_embd: int
            n_ctx_train: int

        return HP(r.get("block_count"), r.get("vocab_size"), r.get("embedding_length"), 64)

    def tensors(self, hp):
        return [TensorSpec("token_embd.weight", (hp.n_vocab, hp.n_embd)),
                TensorSpec("blk.0.tid2eid.weight", (hp.n_vocab, 2), dtypes=("I32", "F32"))]

    graph = BaseGraph


def _table_file(path, dtype, gguf_type):
    w = gguf.GGUFWriter(path, "tabled")
    w.add_block_count(1)
    w.add_uint32("tabled.vocab_size", 8)
    w.add_embedding_length(4)
    w.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))
    w.add_tensor("blk.0.tid2eid.weight", np.arange(16).reshape(8, 2).astype(dtype), raw_dtype=gguf_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_integer_tensors_load_as_integers(tmp_path, plinth_registry):
    from plinth.model import load_model

    reg = plinth_registry(_registering(_Table))
    path = _table_file(tmp_path / "t.gguf", np.int32, gguf.GGMLQuantizationType.I32)
    m = load_model(path, registry=reg)
    table = m.weights["blk.0.tid2eid.weight"]
    assert table.dtype == np.int32 and np.array_equal(table, np.arange(16).reshape(8, 2))


def test_integer_tensors_a_spec_does_not_allow_are_refused(tmp_path, plinth_registry):
    class Floats(_Table):
        def tensors(self, hp):
            return [TensorSpec("token_embd.weight", (hp.n_vocab, hp.n_embd)),
                    TensorSpec("blk.0.tid2eid.weight", (hp.n_vocab, 2))]

    reg = plinth_registry(_registering(Floats))
    path = _table_file(tmp_path / "t.gguf", np.int32, gguf.GGMLQuantizationType.I32)
    with pytest.raises(plinth.UserError, match="tensor 'blk.0.tid2eid.weight' has type I32"):
        plinth.model.load_model(path, registry=reg)


def _registering(arch_cls):
    """A one-architecture plugin object for ``plinth_registry``."""
    from plinth import hookimpl

    class _Plugin:
        @hookimpl
        def plinth_register(self):
            from plinth.manifest import Manifest

            return Manifest(name="tabled-plugin", api_version=plinth.PLUGIN_API_VERSION,
                            architectures={"tabled": "x:y"})

        @hookimpl
        def plinth_get_architecture(self, name):
            return arch_cls() if name == "tabled" else None

    return _Plugin()
