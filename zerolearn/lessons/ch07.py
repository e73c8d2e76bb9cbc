"""Chapter 7's lesson by its former name: :mod:`zerolearn.chapters.ch07.lesson`."""

from zerolearn.chapters.ch07.lesson import DEEPSPEED_CONFIG

__all__ = ["DEEPSPEED_CONFIG"]
