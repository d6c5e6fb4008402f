"""The example plugin tested in isolation with plinth's test kit (the ``plinth_registry`` fixture)."""

import numpy as np
import pytest


@pytest.fixture
def registry(plinth_registry):
    from plinth_example.plugin import plugin

    return plinth_registry(plugin)


def test_architecture_steps(registry):
    md = {"toy-bigram.vocab_size": 4}
    hp = registry.arch_hparams("toy-bigram", md, "toy.gguf")
    assert hp.n_vocab == 4
    specs = registry.arch_tensors("toy-bigram", hp)
    assert specs[0]["shape"] == (4, 4)
    table = np.arange(16, dtype=np.float32).reshape(4, 4)
    graph = registry.arch_build("toy-bigram", hp, {"bigram.weight": table}, registry.make_backend("numpy"))
    np.testing.assert_array_equal(graph.forward([2, 0]).logits, table[[2, 0]])


def test_missing_key_names_key_and_file(registry):
    with pytest.raises(KeyError, match="toy.gguf.*toy-bigram.vocab_size"):
        registry.arch_hparams("toy-bigram", {}, "toy.gguf")


def test_drafter(registry):
    drafter = registry.make_drafter("toy-repeat", target=None)
    drafter.begin(0, [5, 7])
    assert drafter.draft(0, 3, history=[5, 7], pos=2).tokens == (7, 7, 7)
