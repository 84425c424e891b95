"""Errors of model loading, in a module of their own so every loader can raise them without
importing another loader."""


class ModelLoadError(ValueError):
    """The model could not be found or read; the message says what to do."""
