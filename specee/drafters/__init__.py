"""Drafters: each module's proposers, and the speculative methods it registers (`registry`).
Importing the package registers every built-in method, in this order."""
from . import prompt_lookup, ngram, hybrid, draft_model, eagle, kangaroo, auto  # noqa: F401
