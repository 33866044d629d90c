"""What the catalogue changes in quack and CuTeDSL, and only while it compiles or launches.

Importing the catalogue changes nothing: no environment variable, no patch
of quack.  The cute lowering (:mod:`.cute`) enters these settings around its
own quack calls and every one is undone on exit, so a user of quack in the
same process sees quack as installed.  They are scoped, not thread-local: a
thread that calls quack while a catalogue call is inside one sees them too.

- :func:`pipeline_guard` (every compile and launch; a launch compiles on its
  first call): a kernel left with fewer than :data:`MIN_AB_STAGES` mainloop
  stages fails to compile with an error that names the fix.
- :func:`compile_settings` (compile-only calls, :func:`.cute.compile_call`):
  the DSL keeps each kernel's cubin for the SASS gate, in a dump directory of
  the call's own; quack's disk cache is off, because it hands back a loaded
  kernel without its cubin.  Without a GPU the target is :data:`COMPILE_ARCH`:

  * CuTeDSL's architecture is set on its environment manager: the DSL reads
    ``CUTE_DSL_ARCH`` once, when cutlass is first imported, so the variable
    cannot be set later, and unset the DSL targets sm_100a, which quack's
    SM90 GEMM refuses;
  * quack's ``QUACK_ARCH`` is read from ``os.environ`` when quack asks for a
    device's compute capability, and memoised per device: it is set for the
    call and the memo is cleared on entry and exit;
  * the one driver query on the compile path, ``get_max_active_clusters``,
    is answered with Hopper's 132 SMs;
  * ``cute.compile`` builds no JIT engine (``no_jit_engine``): the engine
    is the host launcher, an x86 object compiled and linked per kernel
    (about a tenth of a compile), and without a GPU nothing launches; the
    cubin comes from the dump all the same.  With a GPU the engine is
    built: quack's in-memory cache hands the kernel compiled here to a
    later launch in the same process.

quack and cutlass are imported inside these functions: importing the
catalogue must not load them (seconds of start-up, on every CLI command).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from functools import lru_cache
from typing import Any, Iterator

import torch

from .errors import CatalogueError
from .tile_config import H100_SMS

COMPILE_ARCH = "sm_90a"  # quack's SM90 GEMM: the catalogue's one target
MIN_AB_STAGES = 2


def compile_target() -> str:
    """The architecture a compile-only call targets: the GPU's, or :data:`COMPILE_ARCH` without one."""
    if not torch.cuda.is_available():
        return COMPILE_ARCH
    major, minor = torch.cuda.get_device_capability(0)
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


# --------------------------------------------------------------------------- pipeline depth


class StageShortage(CatalogueError):
    """A tile config whose epilogue staging leaves the mainloop too few A/B stages.
    An untuned call that meets it runs again on :func:`.tile_config.lean_staging`."""


_guard_lock = threading.Lock()
_guard_depth = 0
_unguarded: Any = None  # quack's own _compute_stages while the guard is installed


def _stage_checked(stages_of: Any) -> classmethod:
    """quack's stage computation, refusing a result with too few A/B stages.

    quack sizes the mainloop's A/B ring from the shared memory the epilogue's
    staging buffers leave over.  An epilogue with many wide outputs (five fp32
    tiles besides D) on a cooperative 256-wide tile leaves room for one stage,
    and that kernel never finishes on the H200: a deadlock, not a slow kernel
    (bench/results/h200-2026-11-29-f, ``hang.log``).  The same epilogue gets
    four stages at 128x128 pingpong.  With a Tile operand loaded as well there
    is room for none, and quack fails with a bare "size ... got 0".  The tuner
    tries cooperative configs, so a one-stage kernel would hang it; refusing
    both while compiling turns them into one error that names the fix, which
    ``tune()`` skips and the verifier reports.
    """

    def checked(cls: Any, cta_tile_shape_mnk: Any, *args: Any, **kwargs: Any) -> Any:
        result = stages_of(cls, cta_tile_shape_mnk, *args, **kwargs)
        stages = result[0] if isinstance(result, tuple) and result else None
        if isinstance(stages, int) and stages < MIN_AB_STAGES:
            tile = "x".join(str(d) for d in tuple(cta_tile_shape_mnk)[:2])
            raise StageShortage(
                f"tile config {tile} leaves {stages} A/B pipeline stage{'s' if stages != 1 else ''} once "
                f"this epilogue's staging buffers take their shared memory; the SM90 mainloop needs at "
                f"least {MIN_AB_STAGES} (with one it deadlocks on the H200). Use a 128x128 pingpong "
                "config, or stage less: fewer or narrower extra outputs (bf16 instead of "
                "fp32), fewer Tile operands.")
        return result

    return classmethod(checked)


@contextlib.contextmanager
def pipeline_guard() -> Iterator[None]:
    """Inside, quack's SM90 stage computation (``GemmSm90._compute_stages``,
    whose first result is the A/B stage count) refuses fewer than
    :data:`MIN_AB_STAGES`.  Re-entrant and shared across threads: installed by
    the first caller in, restored by the last one out.  If a later quack
    computes its stages elsewhere the guard stays off, and the verifier's
    timeout is what catches a hang."""
    global _guard_depth, _unguarded
    from quack.gemm_sm90 import GemmSm90

    with _guard_lock:
        if _guard_depth == 0:
            compute = GemmSm90.__dict__.get("_compute_stages")
            if isinstance(compute, classmethod):
                _unguarded = compute
                GemmSm90._compute_stages = _stage_checked(compute.__func__)
        _guard_depth += 1
    try:
        yield
    finally:
        with _guard_lock:
            _guard_depth -= 1
            if _guard_depth == 0 and _unguarded is not None:
                GemmSm90._compute_stages = _unguarded
                _unguarded = None


# --------------------------------------------------------------------------- compile-only

_compile_lock = threading.Lock()  # the settings below are process-wide: one compile at a time


@contextlib.contextmanager
def compile_settings() -> Iterator[None]:
    """Compile in-process with the cubin kept, for :func:`compile_target` (see the module doc)."""
    import cutlass.cute as cute
    import quack.cache
    import quack.cute_dsl_utils
    import quack.gemm_runtime.host as host
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    on_cpu = not torch.cuda.is_available()
    with _compile_lock, tempfile.TemporaryDirectory(prefix="coda-cubin-") as dump_dir, \
            contextlib.ExitStack() as undo:
        saved = envar.keep_cubin, envar.dump_dir, quack.cache.CACHE_ENABLED
        undo.callback(_restore, envar, quack.cache, saved)
        envar.keep_cubin, envar.dump_dir = True, dump_dir
        quack.cache.CACHE_ENABLED = False
        if on_cpu:
            envar.arch = COMPILE_ARCH
            undo.callback(delattr, envar, "arch")  # back to CUTE_DSL_ARCH, or lazy detection
            undo.enter_context(_environ("QUACK_ARCH", COMPILE_ARCH))
            capability = quack.cute_dsl_utils._get_device_capacity_cached
            capability.cache_clear()
            undo.callback(capability.cache_clear)
            clusters = host.get_max_active_clusters
            host.get_max_active_clusters = lambda cluster_size, *a, **k: H100_SMS // cluster_size
            undo.callback(setattr, host, "get_max_active_clusters", clusters)
            undo.callback(setattr, cute, "compile", cute.compile)
            cute.compile = _engineless(type(cute.compile))()
        yield


@lru_cache(maxsize=1)
def _engineless(compile_callable: type) -> type:
    """The DSL's ``cute.compile`` class, compiling without a JIT engine (see the module doc)."""

    class EnginelessCompile(compile_callable):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, no_jit_engine=True, **kwargs)

        def __getitem__(self, options: Any) -> Any:
            return EnginelessCompile(options)

    return EnginelessCompile


def _restore(envar: Any, cache: Any, saved: tuple) -> None:
    envar.keep_cubin, envar.dump_dir, cache.CACHE_ENABLED = saved


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
