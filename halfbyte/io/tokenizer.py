"""The model's tokenizer: tokenizer.json through the `tokenizers` library, special tokens and
the chat template from tokenizer_config.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from halfbyte.errors import CorruptFileError, ModelNotFoundError
from halfbyte.io.chat_template import ChatTemplate
from halfbyte.io.model_dir import read_optional_json


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelNotFoundError(f"{model_dir} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise CorruptFileError(f"{path} is not a valid tokenizer ({str(e).splitlines()[0]})") from None
        cfg = read_optional_json(model_dir / "tokenizer_config.json")
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        template = cfg.get("chat_template")
        jinja = model_dir / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template = (
            ChatTemplate(template, self.bos_token or "", self.eos_token or "") if template else None
        )

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # tokenizer.json's post-processor adds BOS for most models; add it here when the
        # config asks for it and the post-processor did not.
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        if self.chat_template is None:
            from halfbyte.errors import UnsupportedModelError

            raise UnsupportedModelError("this model has no chat template; use generate instead of chat")
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        # The template already wrote any BOS it wants, as transformers assumes.
        return self.encode(text, add_special_tokens=False)
