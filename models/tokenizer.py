"""A small wrapper over a checkpoint's ``tokenizer.json`` (the ``tokenizers`` library).

BOS policy, matching what the checkpoint's own Hugging Face tokenizer does:

* ``tokenizer_config.json`` sets ``add_bos_token``: encode without the post-processor's special
  tokens and prepend BOS exactly when ``add_bos_token`` is true (Llama 2, Mistral);
* otherwise the ``tokenizer.json`` post-processor decides (Llama 3's template adds
  ``<|begin_of_text|>``; Qwen's adds nothing).

EOS ids are the union of generation_config.json / config.json ``eos_token_id`` (int or list)
and tokenizer_config.json's ``eos_token``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from pdserve.models.config import read_special_ids

logger = logging.getLogger(__name__)


def _token_content(value: Any) -> str | None:
    """tokenizer_config special tokens are a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Text <-> token ids for one checkpoint."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, eos_token_ids: Sequence[int] = (),
                 bos_token_id: int | None = None, add_bos_token: bool | None = None,
                 chat_template: str | None = None):
        self._tok = tokenizer  # the tokenizers.Tokenizer doing the work
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)  # generation stops on these
        self.bos_token_id: int | None = bos_token_id  # prepended per the BOS policy
        self.add_bos_token: bool | None = add_bos_token  # None: the post-processor decides
        self.chat_template: str | None = chat_template  # Jinja template, when the model has one

    @classmethod
    def from_hf_folder(cls, model_dir: str | Path) -> Tokenizer:
        """Read ``tokenizer.json`` (+ tokenizer_config.json, generation_config.json,
        config.json when present) from a Hugging Face checkpoint folder. Any checkpoint, GGUF
        included: ``models.checkpoint.open_checkpoint(path).tokenizer()``."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}; pdserve needs the fast "
                                    "(tokenizers) format, e.g. save it with transformers' "
                                    "AutoTokenizer.from_pretrained(...).save_pretrained(dir)")
        tok = tokenizers.Tokenizer.from_file(str(path))
        tok_cfg: dict[str, Any] = {}
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            with open(cfg_path, encoding="utf-8") as f:
                tok_cfg = json.load(f)
        eos, bos = read_special_ids(model_dir)
        eos_text = _token_content(tok_cfg.get("eos_token"))
        eos_id = tok.token_to_id(eos_text) if eos_text else None
        if eos_id is not None and eos_id not in eos:
            eos = (*eos, eos_id)
        if bos is None:
            bos_text = _token_content(tok_cfg.get("bos_token"))
            bos = tok.token_to_id(bos_text) if bos_text else None
        add_bos = tok_cfg.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ValueError(f"add_bos_token in {cfg_path} must be a bool, got {add_bos!r}")
        template = tok_cfg.get("chat_template")
        return cls(tok, eos_token_ids=eos, bos_token_id=bos, add_bos_token=add_bos,
                   chat_template=template if isinstance(template, str) else None)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (the model's embedding may have more rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; BOS per the module's policy when ``add_special_tokens``."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        if self.add_bos_token is None:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The ``tokenizers.Tokenizer`` doing the work (incremental decoding streams on it; a
        grammar engine reads the vocabulary from it)."""
        return self._tok

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``; ids beyond the tokenizer's vocab are dropped."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)
