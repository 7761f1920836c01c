import pytest
import torch

from draftsmith.demo import SHIPPED_DRAFTER, initial_drafter
from draftsmith.export import load_export


def test_the_shipped_drafter_fits_the_embedded_target():
    """The drafter in the package (benchmarks/ship_drafter.py) loads as an SGLang export built for
    SmolLM2-135M (vocab 49152, hidden 576, 30 layers, the default aux layers) with a sound vocab."""
    drafter, config = load_export(SHIPPED_DRAFTER)
    c = drafter.cfg
    assert (c.vocab_size, c.target_hidden_size, c.target_num_layers, c.aux_layer_ids) == (49152, 576, 30, (1, 14, 26))
    ids = drafter.to_target(torch.arange(c.draft_vocab_size))
    assert torch.equal(ids, ids.sort().values) and int(ids.max()) < c.vocab_size
    assert drafter.t2d[ids].all() and int(drafter.t2d.sum()) == c.draft_vocab_size
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]


def test_start_from_names_the_drafter_or_says_what_to_give(tmp_path):
    assert initial_drafter("shipped") == str(SHIPPED_DRAFTER)
    assert initial_drafter("scratch") is None
    with pytest.raises(FileNotFoundError, match="--start-from scratch"):
        initial_drafter(str(tmp_path))
