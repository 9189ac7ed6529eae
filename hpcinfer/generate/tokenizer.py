"""Text <-> token ids with the tokenizer stored in the checkpoint (a Hugging Face `tokenizers` JSON), and the
checkpoint's chat template (Jinja, rendered as transformers renders it)."""

from __future__ import annotations

from tokenizers import Tokenizer


class TextTokenizer:
    def __init__(self, tokenizer_json: str, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None):
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.chat_template, self.bos_token, self.eos_token = chat_template, bos_token, eos_token

    @classmethod
    def from_checkpoint(cls, ckpt) -> "TextTokenizer | None":
        text = ckpt.tokenizer_json()
        if text is None:
            return None
        attrs = ckpt.tokenizer_attrs()
        return cls(text, attrs.get("chat_template"), attrs.get("bos_token"), attrs.get("eos_token"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode_chat(self, text: str) -> list[int]:
        """One user turn, with the generation prompt, as transformers' apply_chat_template(tokenize=True)."""
        return self.encode(self.render_chat([{"role": "user", "content": text}]), add_special_tokens=False)

    def render_chat(self, messages: list[dict]) -> str:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True,
                                                          bos_token=self.bos_token or "",
                                                          eos_token=self.eos_token or "")
