import pytest

from plinth.hparams import HParamsError, KeyReader


def reader(**md):
    return KeyReader({f"llama.{k}": v for k, v in md.items()}, "model.gguf", "llama")


def test_scalar_broadcasts_to_every_layer():
    per = reader(head_count_kv=3).get_key_or_arr("head_count_kv", 4)
    assert list(per) == [3, 3, 3, 3] and per.uniform


def test_array_needs_exactly_n_layer_entries():
    per = reader(expert_used_count=[2, 4, 8]).get_key_or_arr("expert_used_count", 3)
    assert per[2] == 8 and not per.uniform
    with pytest.raises(HParamsError, match=r"'llama.expert_used_count' has 3 entries, expected n_layer = 4"):
        reader(expert_used_count=[2, 4, 8]).get_key_or_arr("expert_used_count", 4)


def test_per_layer_accessor_raises_out_of_range():
    per = reader(head_count_kv=3).get_key_or_arr("head_count_kv", 2)
    with pytest.raises(IndexError, match=r"layer 5 out of range for 'llama.head_count_kv' \(n_layer = 2\)"):
        per[5]


def test_missing_required_key_names_key_and_file():
    with pytest.raises(HParamsError, match=r"model.gguf: missing required key 'llama.block_count'"):
        reader().get("block_count")
    assert reader().get("rope.freq_base", float, required=False, default=1e4) == 1e4
    assert list(reader().get_key_or_arr("sliding_window", 2, required=False, default=0)) == [0, 0]


def test_type_errors_are_named():
    with pytest.raises(HParamsError, match="key 'llama.block_count' = 'x': expected an integer"):
        reader(block_count="x").get("block_count")
    with pytest.raises(HParamsError, match="array of 2 values, expected a scalar"):
        reader(block_count=[1, 2]).get("block_count")
