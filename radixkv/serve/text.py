"""Moved to :mod:`radixkv.text.stream` (issue 23); this old path re-exports it for now."""

from radixkv.text.stream import StopMatcher, TextStream

__all__ = ["StopMatcher", "TextStream"]
