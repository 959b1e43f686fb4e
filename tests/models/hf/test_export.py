"""The Hugging Face directory of ``export --format hf`` stores tied embeddings once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.hf.export import HF_FILES_DIR, write_hf_directory

safetensors = pytest.importorskip("safetensors.torch")


@pytest.mark.parametrize("tied", [True, False])
def test_tied_embeddings_are_written_once_under_the_input_embedding_name(
    tmp_path: Path, tied: bool
) -> None:
    (tmp_path / HF_FILES_DIR).mkdir()
    config = {"vocab_size": 6, "tie_word_embeddings": tied}
    (tmp_path / HF_FILES_DIR / "config.json").write_text(json.dumps(config))
    embedding = torch.randn(6, 4)
    # A checkpoint's order may put the output projection first.
    state = {
        "lm_head.weight": embedding.clone() if tied else torch.randn(6, 4),
        "model.embed_tokens.weight": embedding,
        "model.norm.weight": torch.ones(4),
        "model.zeros_a": torch.zeros(6, 4),
        "model.zeros_b": torch.zeros(6, 4),
    }
    write_hf_directory(state, tmp_path, tmp_path / "exported")

    written = safetensors.load_file(str(tmp_path / "exported" / "model.safetensors"))
    expected = set(state) - ({"lm_head.weight"} if tied else set())
    assert set(written) == expected
    assert torch.equal(written["model.embed_tokens.weight"], embedding)


def test_a_mixture_of_experts_is_exported_per_expert_and_loads_with_equal_logits(
    tmp_path: Path,
) -> None:
    """The stacked experts of a run's state are written one tensor per expert, as the Hub's
    files hold them; ``from_pretrained`` reads the directory back into the same model."""
    import shutil

    transformers = pytest.importorskip("transformers")
    from tests.recipes.families import FAMILY_BY_NAME, make_family_dir

    source = make_family_dir(FAMILY_BY_NAME["Mixtral"], tmp_path / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    (tmp_path / HF_FILES_DIR).mkdir()
    shutil.copy2(source / "config.json", tmp_path / HF_FILES_DIR / "config.json")
    write_hf_directory(model.state_dict(), tmp_path, tmp_path / "exported")

    written = safetensors.load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in written
    assert not any("gate_up_proj" in key for key in written)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, model(tokens).logits)
