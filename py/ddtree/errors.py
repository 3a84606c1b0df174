"""Exceptions raised at ddtree's boundaries. Each message names the file, tensor, field or argument at fault."""


class DDTreeError(Exception):
    """Base class of every error ddtree raises on bad input."""


class ConfigError(DDTreeError, ValueError):
    """A config.json field is missing, malformed or unsupported."""


class CheckpointError(DDTreeError, ValueError):
    """A checkpoint file or tensor is missing, truncated, or of the wrong dtype or shape."""


class RequestError(DDTreeError, ValueError):
    """A generation request is invalid (prompt ids, lengths, stream counts)."""
