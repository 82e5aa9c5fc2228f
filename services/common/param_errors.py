"""The error every check of a user-supplied generation parameter raises (sampling parameters,
structured outputs): it names the field, which the gateway reports as an OpenAI 400's `param`."""

from __future__ import annotations


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; `param` is the offending field's name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
