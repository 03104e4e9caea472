"""Models and tokenizers without the hub: a local folder, or a tiny Qwen2 built from a config.

The built tokenizer is a byte-level BPE trained on the task's own text, with every digit kept as
its own token (as Qwen's tokenizer does) and a ChatML chat template, so a tiny model reads short
prompts and the same code paths serve a real Qwen tokenizer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from treadle.config import TinyModelConfig
from treadle.core.errors import UserError

log = logging.getLogger(__name__)

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``corpus`` with ChatML special tokens.

    Args:
        corpus: texts the tokenizer should encode compactly (prompts and demonstrations).
        vocab_size: target vocabulary size (tokens), at least 256 + 3 (bytes + special tokens).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, 260),
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, unk_token=None
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_config(
    cfg: TinyModelConfig, vocab_size: int, eos: int | None = None, pad: int | None = None
) -> Qwen2Config:
    """The Qwen2 config of the model :func:`build_tiny_model` builds (tied embeddings)."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
    )


def build_tiny_model(
    cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> Qwen2ForCausalLM:
    """A Qwen2-architecture causal LM with seeded random weights and tied embeddings."""
    config = tiny_config(cfg, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def load_model(
    path: str | Path, dtype: str = "float32"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a local Hugging Face causal-LM folder and its tokenizer.

    Raises:
        UserError: the folder does not exist or holds no loadable model/tokenizer.
    """
    folder = require_model_folder(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as e:
        raise UserError(f"model.path {folder}: cannot load model or tokenizer: {e}") from None
    require_chat_template(tokenizer, folder)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_critic(path: str | Path) -> PreTrainedModel:
    """A critic for PPO: the model in ``path`` (a policy or a saved critic) with a one-output
    value head (``AutoModelForTokenClassification``, ``num_labels=1``, no dropout) in fp32.
    Loading a policy folder keeps its transformer weights and initialises the value head.

    Raises:
        UserError: the folder does not exist or holds no loadable model.
    """
    folder = require_model_folder(path)
    try:
        config = AutoConfig.from_pretrained(folder, num_labels=1)
        config.classifier_dropout = 0.0  # a value model regresses: no dropout on its head
        return AutoModelForTokenClassification.from_pretrained(
            folder, config=config, dtype=torch.float32
        )
    except (OSError, ValueError) as e:
        raise UserError(f"critic from {folder}: cannot load the model: {e}") from None


def require_model_folder(path: str | Path) -> Path:
    """``path`` as a folder that holds a Hugging Face model.

    Raises:
        UserError: no ``config.json`` there, or no weights (``*.safetensors`` or
            ``pytorch_model*.bin``) beside it.
    """
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise UserError(
            f"model.path {folder}: no Hugging Face model folder there (config.json missing); "
            "pass a local folder, or leave model.path unset to build the tiny model"
        )
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
        raise UserError(
            f"model.path {folder}: config.json but no weights (no *.safetensors or "
            "pytorch_model*.bin); copy the model's weight files there, or leave model.path unset "
            "to build the tiny model"
        )
    return folder


def require_readable_model(folder: Path) -> None:
    """Open what a run loads from a model folder before anything is made: ``config.json``,
    the tokenizer, and each safetensors file's header (``safe_open`` checks the header covers
    the file, so a truncated copy is found without reading the weights).

    Raises:
        UserError: naming the file that cannot be read and why.
    """
    from safetensors import SafetensorError, safe_open

    try:
        AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise UserError(f"{folder}/config.json cannot be read ({e}); copy it again") from None
    try:
        AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as e:  # a corrupt tokenizer.json is a ValueError
        raise UserError(f"{folder}: the tokenizer cannot be loaded ({e}); copy it again") from None
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt") as weights:
                weights.keys()
        except (SafetensorError, OSError) as e:
            raise UserError(f"{file} cannot be read ({e}); copy the weights again") from None


def parameter_count(folder: str | Path) -> int:
    """Parameters stored in a model folder's ``*.safetensors`` files, read from their headers
    (no weights are loaded); 0 for a folder with none (``pytorch_model*.bin`` only). A tied
    output layer is stored once and counted once. A file whose header cannot be read counts 0
    (:func:`require_readable_model` names it)."""
    import json
    import math

    total = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        try:
            with file.open("rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return total


def require_chat_template(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Prompts are rendered with the tokenizer's chat template: it must have one.

    Raises:
        UserError: ``tokenizer.chat_template`` is unset (naming ``folder``).
    """
    if not tokenizer.chat_template:
        raise UserError(
            f"{folder}: the tokenizer has no chat template (no chat_template in "
            "tokenizer_config.json or chat_template.jinja); use a chat/instruct model's "
            "tokenizer, or add a template to that folder"
        )


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> Path:
    """Write model (safetensors) and tokenizer in Hugging Face format to ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids that end an assistant turn: eos, plus ``<|im_end|>`` when the vocabulary has it."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)
