"""The PretrainedSaver contract (what :func:`treadle.store.atomic.save_model_atomic` and the
checkpoints save), for every implementation: a Hugging Face model, its tokenizer, and a training
backend (the Ray trainer group's ``save_pretrained`` is checked in test_training_backend.py):
``save_pretrained(folder)`` writes a folder ``from_pretrained`` loads back to the same thing."""

from __future__ import annotations

import pytest
import torch
from integration.tiny import build_tiny_folder
from transformers import AutoModelForCausalLM, AutoTokenizer

from treadle.config import TrainerConfig
from treadle.store.atomic import save_model_atomic
from treadle.store.models import load_model
from treadle.train.torch_backend import TorchBackend


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("saver_contract") / "model"
    build_tiny_folder(path)
    return path


@pytest.mark.parametrize("saver", ["model", "backend"])
def test_a_saved_model_loads_back_with_its_tokenizer(saver, folder, tmp_path):
    model, tokenizer = load_model(folder)
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # not the weights on disk
    what = model if saver == "model" else TorchBackend(model, TrainerConfig(), total_steps=1)
    out = save_model_atomic(what, tokenizer, tmp_path / "saved")
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert all(torch.equal(back[n], t) for n, t in model.state_dict().items())
    again = AutoTokenizer.from_pretrained(out)
    assert again("What is 3 + 4?").input_ids == tokenizer("What is 3 + 4?").input_ids
    assert again.chat_template == tokenizer.chat_template
