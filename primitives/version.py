"""The catalogue's version: part of every kernel fingerprint and verdict cache key.
Bump it whenever the semantics or the lowering of any primitive changes."""

CATALOGUE_VERSION = "2026.12.07-3"
