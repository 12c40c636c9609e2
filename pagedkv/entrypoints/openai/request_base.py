"""OpenAIBaseModel (vLLM's name): the base of request bodies. Fields a request sends that the
body does not define are ignored, as OpenAI does, and named in a WARNING, as vLLM does, so a
typo (``max_token``) is not silent: at most one line per body type per interval (a client sends
the same body many times), with how many were held back."""

from __future__ import annotations

import logging

from pydantic import BaseModel, model_validator

from pagedkv.transport.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)


def ignored_fields(model: BaseModel, data: dict, where: str = "") -> list[str]:
    """The keys of ``data`` (what ``model`` was validated from) that no field of ``model``
    takes, by name or alias; and, in nested bodies given as objects or lists of objects, theirs
    (``messages[0].nme``)."""
    fields = type(model).model_fields
    names = {name: name for name in fields}
    names |= {f.alias: name for name, f in fields.items() if f.alias is not None}
    ignored: list[str] = []
    for key, value in data.items():
        if key not in names:
            ignored.append(f"{where}{key}")
            continue
        field = getattr(model, names[key])
        if isinstance(field, BaseModel) and isinstance(value, dict):
            ignored += ignored_fields(field, value, f"{where}{key}.")
        elif isinstance(field, list) and isinstance(value, list):
            for i, (item, given) in enumerate(zip(field, value)):
                if isinstance(item, BaseModel) and isinstance(given, dict):
                    ignored += ignored_fields(item, given, f"{where}{key}[{i}].")
    return ignored


class OpenAIBaseModel(BaseModel):
    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored_fields(cls, data, handler):
        request = handler(data)
        if isinstance(data, dict) and (ignored := ignored_fields(request, data)):
            _log.warning(
                cls.__name__,
                "The following fields were present in the request but ignored: %s",
                ignored,
            )
        return request
