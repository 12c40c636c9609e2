"""Chat messages -> a prompt, through the tokenizer's chat template (``LLM.chat`` and the
server's ``/v1/chat/completions`` alike)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def render_chat(tokenizer, messages: Sequence[Mapping], add_generation_prompt: bool = True) -> dict:
    """``{"prompt": text, "prompt_token_ids": ids}``. The template already holds any special
    tokens (BOS), so the text is tokenized without adding them again. ValueError (starting with
    ``messages``) if there is no template or it rejects the messages."""
    if tokenizer is None:
        raise ValueError("messages need a chat template, and this model has no tokenizer")
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # no template, or one that rejects these messages (jinja)
        raise ValueError(f"messages cannot go through the chat template: {e}") from None
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
