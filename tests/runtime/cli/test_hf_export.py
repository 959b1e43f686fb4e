"""The Hugging Face directory of ``export --format hf`` stores tied embeddings once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.cli.hf_export import HF_FILES_DIR, write_hf_directory

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
