"""One of each: the atomic write, the cache root every cache lives under, and
the versions that cache keys and run records name (storage.py, versions.py)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from coda_agent import storage, versions
from coda_agent.primitives.tuning import TuningCache
from coda_agent.verifier import cache as verdict_cache
from coda_agent.verifier import compile_cache


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "deep" / "result.json"
    storage.write_json(path, {"n": 1})
    with pytest.raises(TypeError):
        storage.write_atomic(path, object())  # type: ignore[arg-type] - fails mid-write
    assert path.read_text() == '{\n  "n": 1\n}\n'
    assert [p.name for p in path.parent.iterdir()] == ["result.json"]


def _cache_dirs() -> set[Path]:
    return {verdict_cache.cache_dir().parent, compile_cache.cache_dir().parent, TuningCache().directory.parent}


def test_every_cache_lives_under_one_root(tmp_path, monkeypatch):
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path / "coda"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _cache_dirs() == {tmp_path / "coda"}
    monkeypatch.delenv("CODA_CACHE_DIR")
    assert _cache_dirs() == {tmp_path / "xdg" / "coda-agent"}
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty means unset (XDG base directory spec)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _cache_dirs() == {tmp_path / "home" / ".cache" / "coda-agent"}
    assert len({verdict_cache.cache_dir(), compile_cache.cache_dir(), TuningCache().directory}) == 3


def test_versions_name_what_is_installed_and_keys_fail_closed_without_it(monkeypatch):
    got = versions.versions(("torch", "no-such-distribution"))
    assert got == {"torch": metadata.version("torch"), "no-such-distribution": versions.ABSENT}
    record = versions.environment()
    assert set(record) >= {"python", "coda-agent", "quack-kernels", "nvidia-cutlass-dsl", "torch", "cuda", "gpu"}
    assert set(verdict_cache.library_versions()) == {"catalogue", *versions.KERNEL_LIBRARIES}

    real = metadata.version

    def without_quack(dist: str) -> str:
        if dist == "quack-kernels":
            raise metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(metadata, "version", without_quack)
    with pytest.raises(verdict_cache.CacheKeyError, match="quack-kernels"):
        verdict_cache.library_versions()
