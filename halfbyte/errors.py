"""Errors a user can cause. Each carries a one-line message; the CLI prints it and exits non-zero."""


class HalfbyteError(Exception):
    """Base of every error caused by bad input or environment, never by a bug."""


class ModelNotFoundError(HalfbyteError):
    """The model path or name does not resolve to a model directory."""


class UnsupportedModelError(HalfbyteError):
    """The model's architecture or a config value is not supported."""


class CorruptFileError(HalfbyteError):
    """A weights, tokenizer or config file is truncated or malformed."""


class InvalidParameterError(HalfbyteError):
    """A sampling or engine parameter is out of range; the message names the field."""


class PromptTooLongError(HalfbyteError):
    """The prompt does not fit the context window."""


class QuantizationError(HalfbyteError):
    """A quantized weight is malformed, or quantizing a weight failed (bad Hessian, bad bits)."""
