"""Tile-configuration choice: fast, persistent, and visible in every report.

The configuration decides epilogue-heavy speed (an H200 measurement: the
dSwiGLU backward with its row reduction takes 2.86 ms at quack's default
128x192 pingpong and 1.26 ms at 128x128 pingpong, against 0.83 ms for the
plain GEMM), but quack's full autotune takes 74 s for one shape.  So:

1. ``gemm(config=None)`` looks the call up in an on-disk :class:`TuningCache`
   (inside :func:`autotune`, a miss is tuned on the spot);
2. otherwise, on a miss it uses :func:`coda_agent.primitives.tile_config.default_config`, a
   heuristic on the epilogue's weight (reductions, paired tiles, operand count);
3. :func:`tune` times a *pruned* candidate list (:func:`candidates_for`: six
   configs that won somewhere on Hopper, or for a promoting fp8 GEMM six that
   hold its two accumulators) with device events on the real shapes and
   stores the winner; the benchmark does this once per (program, shape) and the
   verifier's performance stage then reads the cache instead of searching (each
   GPU runner gets a copy of it in its scratch folder, and its digest is part
   of the verdict's key: ``verifier/remote.py``, ``verifier/cache.py``).

Keys are fail-closed, like verdict keys: the epilogue's quack semantic digest
(fn source and everything it references), the catalogue version, the library
versions, the GPU name, M, N, K and the dtypes.  An epilogue that exposes
reduction partials is never retuned: its partial layout depends on ``tile_n``
and is part of the program's contract.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import time
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from coda_agent.storage import cache_dir, write_atomic
from coda_agent.versions import versions

from . import cute
from .fp8 import is_fp8, mainloop_key
from .lowering import set_within
from .tile_config import TileConfig, fits_promoted, tunable
from .timing import measure_each, measure_steady
from .version import CATALOGUE_VERSION

CANDIDATES: tuple[TileConfig, ...] = (
    TileConfig(128, 192, 2, 1, True),
    TileConfig(128, 128, 1, 1, True),
    TileConfig(128, 128, 2, 1, True),
    TileConfig(128, 256, 1, 1, False),
    TileConfig(256, 128, 2, 1, False),
    TileConfig(128, 192, 1, 1, True),
)

# The wide pool (``autotune(pool="wide")``): CANDIDATES and large clustered tiles like those
# cuBLAS picks for a training step's GEMMs (H200 run 19's compile row: 128x256 c2x1, 256x128 c1x2,
# 192x192 and 320x128).  A bigger tile moves fewer operand bytes per FLOP and a cluster multicasts
# its shared operand, so it may cost less energy per FLOP; under the power cap a step runs at,
# energy is time, which only back-to-back (steady) timing shows.  All three are quack's cooperative
# kernel.  Compiled for sm_90a with the LLaMA step's epilogues, 128x256 c2x1 and 256x128 c1x2 spill
# nothing and 256x160 only in dSwiGLU (120 STL); 256x192 and 192x128 pingpong spill 170-670 STL
# in four of them, so they stay out.
WIDE_CANDIDATES: tuple[TileConfig, ...] = (
    *CANDIDATES,
    TileConfig(128, 256, 2, 1, False),
    TileConfig(256, 128, 1, 2, False),
    TileConfig(256, 160, 2, 1, False),
)
POOLS = {"default": CANDIDATES, "wide": WIDE_CANDIDATES}


# An fp8 GEMM that promotes its partial sums keeps a second fp32 accumulator, and most CANDIDATES
# then spill (``tile_config.fits_promoted``): its candidates are those that fit, run cooperative
# where they must, and the pingpong tile that holds both accumulators, 128x64, which keeps one
# tile's epilogue overlapping the next tile's mainloop.
PROMOTED_PINGPONG: tuple[TileConfig, ...] = (TileConfig(128, 64, 1, 1, True), TileConfig(128, 64, 2, 1, True))


def candidates_for(epi: Any, operands: Mapping[str, Any], promote: bool = False,
                   pool: str = "default") -> list[TileConfig]:
    """The configs :func:`tune` may pick for this epilogue: those of ``pool`` (:data:`POOLS`:
    :data:`CANDIDATES`, or :data:`WIDE_CANDIDATES`), or for an fp8 GEMM that promotes
    (``promote``) those of them and of their cooperative forms and :data:`PROMOTED_PINGPONG` that
    hold both accumulators without spilling; a head statistic needs whole heads per tile.  (An
    epilogue exposing reduction partials is never tuned at all: ``tile_config.tunable``.)"""
    head_dims = _head_dims(epi, operands)
    if pool not in POOLS:
        raise ValueError(f"tuning pool {pool!r} does not exist; pick one of {sorted(POOLS)}")
    configs = POOLS[pool]
    if promote:
        coop = (c.cooperative() for c in configs)
        configs = tuple(c for c in dict.fromkeys((*configs, *coop, *PROMOTED_PINGPONG)) if fits_promoted(c))
    return [cfg for cfg in configs if _whole_heads(cfg, head_dims)]


def _head_dims(epi: Any, operands: Mapping[str, Any]) -> tuple[int, ...]:
    return tuple(operands[s] for s in epi.head_stats) if epi is not None else ()


def _whole_heads(cfg: TileConfig, head_dims: tuple[int, ...]) -> bool:
    """A head statistic needs whole heads per tile (``gemm`` refuses any other config)."""
    return not any(cfg.tile_n % hd for hd in head_dims)


@lru_cache(maxsize=1)
def _versions() -> tuple[str, ...]:
    return tuple(versions(("quack-kernels", "nvidia-cutlass-dsl", "torch")).values())


def tuning_key(epi: Any, m: int, n: int, k: int, dtype: Any, device_name: str) -> str:
    """Fail-closed key: raises if the epilogue cannot be fingerprinted."""
    digest = cute.epimod(epi).semantic_digest if epi is not None else "plain"
    raw = json.dumps([digest, CATALOGUE_VERSION, _versions(), device_name, m, n, k, str(dtype)])
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


class TuningCache:
    """One JSON file per key: {"config": {...}, "times_ms": {...}, "created": ...}."""

    def __init__(self, directory: Path | None = None):
        self.directory = directory or cache_dir("tuning")

    def get(self, key: str) -> TileConfig | None:
        path = self.directory / f"{key}.json"
        try:
            data = json.loads(path.read_text())
            return TileConfig(**data["config"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, config: TileConfig, times_ms: dict[str, float], regime: str = "single calls",
            call: Mapping[str, Any] | None = None) -> None:
        """``call``: what was tuned, for a reader of the folder (the key is a hash): the
        epilogue's name, [M, N, K], the operands' dtype and the GPU."""
        payload = {"config": config.__dict__, "times_ms": times_ms, "regime": regime, **(call or {}),
                   "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        write_atomic(self.directory / f"{key}.json", json.dumps(payload))


# In-process memo of lookups: gemm() consults the cache on every call, and the
# GPU must never wait on the host for it: computing the key reads three
# packages' metadata (1.7 ms), and paid on every call that host time makes a
# 3-GEMM program run 13x slower than its GEMMs on the H200.  The memo lives on the
# epilogue object itself (an id() key could be reused by a later program's
# epilogue); a new tuning result bumps the generation and so empties every memo.
_PLAIN_MEMO: dict[tuple, TileConfig | None] = {}
_generation = 0


def _memo(epi: Any) -> dict[tuple, TileConfig | None]:
    if epi is None:
        return _PLAIN_MEMO
    gen, memo = epi._lowered.get("tuning_memo", (None, None))
    if gen != _generation:
        memo = {}
        epi._lowered["tuning_memo"] = (_generation, memo)
    return memo


def _forget_lookups() -> None:
    global _generation
    _generation += 1
    _PLAIN_MEMO.clear()


@lru_cache(maxsize=16)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def lookup(epi: Any, m: int, n: int, k: int, dtype: Any, device: Any,
           operands: dict[str, Any]) -> TileConfig | None:
    """The cached config for this call, or None (never raises: a miss is a miss)."""
    if not tunable(epi):
        return None
    head_dims = _head_dims(epi, operands)
    memo = _memo(epi)
    memo_key = (m, n, k, dtype, getattr(device, "index", None), head_dims)
    if memo_key in memo:
        return memo[memo_key]
    try:
        key = tuning_key(epi, m, n, k, dtype, _device_name(device.index or 0))
    except Exception:  # noqa: BLE001 - no key, no cache (fail closed)
        return None
    cfg = TuningCache().get(key)
    cfg = cfg if cfg is not None and _whole_heads(cfg, head_dims) else None
    memo[memo_key] = cfg
    return cfg


class _Session(list):
    """What an :func:`autotune` block tunes with, and its record (a list, one entry per tuned call);
    ``untuned``: the [M, N, K] of misses it could not tune because a CUDA graph was being captured."""

    def __init__(self, steady_s: float | None, pool: str):
        super().__init__()
        self.steady_s, self.pool = steady_s, pool
        self.untuned: list[list[int]] = []


_autotune: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("coda_autotune", default=None)


@contextlib.contextmanager
def autotune(steady_s: float | None = None, pool: str = "default") -> Iterator[list[dict]]:
    """Inside, a cute ``gemm(config=None)`` whose lookup misses is tuned on the spot
    (:func:`tune`) and its winner cached; yields a record per tuned call.  Calls that
    accumulate into a buffer are not tuned (timing them would keep adding into it).

    ``steady_s``: time each candidate back to back for that many seconds (after the clock
    settles, ``measure_steady``) instead of in flushed single calls on a rested GPU.  A training
    step runs its GEMMs at the power cap, where what a config costs is its energy: H200 run 18
    tuned a step's GEMMs in single calls, and their winners ran the step at a lower clock and
    2-3% slower than the untuned heuristic.  ``pool``: the candidates (:data:`POOLS`), the wide
    one for a step's tiles judged under sustained load.

    The scope is a context variable, and autograd runs a CUDA backward on device threads of
    its own, which do not see it: inside, autograd runs backward on the calling thread
    (``set_multithreading_enabled(False)``), so a training step's backward GEMMs tune too.

    A call made while its stream is captured into a CUDA graph (torch.compile's
    ``reduce-overhead`` records the backward on its first run) is not tuned: timing needs
    synchronisation, which invalidates the capture.  It runs the untuned config, its [M, N, K]
    lands in ``record.untuned``, and leaving the block warns with the fix: tune such a model in
    an eager step (for a compiled one, inside ``torch.compiler.set_stance("force_eager")``), whose
    winners the captured calls then read.

    For a patched model (``coda_agent.autotune`` is this function)::

        with coda_agent.autotune(pool="wide"), torch.compiler.set_stance("force_eager"):
            model(input_ids=ids, labels=ids).loss.backward()   # one step's shapes, tuned once
        model.zero_grad(set_to_none=True)

    The winners persist in the tuning cache (``$CODA_CACHE_DIR/tuning``, by default
    ``~/.cache/coda-agent/tuning``), one JSON file per call that names its epilogue, [M, N, K]
    and GPU; later processes on the same GPU model and library versions read them."""
    if steady_s is not None and not steady_s > 0:
        raise ValueError(f"autotune: steady_s is the seconds each candidate runs back to back, a positive "
                         f"number; got {steady_s!r} (None times single calls)")
    if pool not in POOLS:
        raise ValueError(f"autotune: pool {pool!r} does not exist; pick one of {sorted(POOLS)}")
    with set_within(_autotune, _Session(steady_s, pool)) as record, torch.autograd.set_multithreading_enabled(False):
        yield record
    if record.untuned:
        shapes = ", ".join(str(mnk) for mnk in record.untuned[:4]) + (" ..." if len(record.untuned) > 4 else "")
        warnings.warn(f"autotune: {len(record.untuned)} GEMM call(s) ran untuned because a CUDA graph was being "
                      f"captured ({shapes}); tune in an eager step: run it inside "
                      f"torch.compiler.set_stance('force_eager') within autotune()", stacklevel=3)


def tunable_now(A: torch.Tensor, mnk: tuple[int, int, int]) -> bool:
    """Inside :func:`autotune`, whether a miss of shape ``mnk`` can be tuned on the spot: not while
    a CUDA graph captures A's stream (the miss is noted in the session's ``untuned``)."""
    session = _autotune.get()
    if session is None:
        return False
    if A.is_cuda and torch.cuda.is_current_stream_capturing():
        session.untuned.append(list(mnk))
        return False
    return True


def tune(epi: Any, A: Any, B: Any, operands: dict[str, Any], out_dtype: Any, reps: int = 10,
         fast_accum: bool = False, steady_s: float | None = None) -> tuple[TileConfig, dict]:
    """Time the candidates (:func:`candidates_for`) for one call that ``gemm`` has validated (D in
    ``out_dtype``; ``fast_accum`` for fp8), interleaved (:func:`measure_each`), or each back to
    back for ``steady_s`` seconds (:func:`measure_steady`; the enclosing :func:`autotune`'s
    choice when None), store and return the fastest."""
    session = _autotune.get()
    if steady_s is None and session is not None:
        steady_s = session.steady_s
    m, k = A.shape
    n = B.shape[1]
    times: dict[str, float] = {}

    # One set of result buffers for every candidate: a tunable epilogue exposes no
    # per-tile partials, so nothing in them depends on the tile.
    buffers = (epi.result_buffers(m, n, operands, out_dtype, 1, A.device) if epi is not None
               else {"D": torch.empty(m, n, dtype=out_dtype, device=A.device)})

    def call(cfg: TileConfig) -> Callable[[], Any]:
        def run() -> Any:
            return cute.run(epi, A, B, operands, buffers=buffers, config=cfg, accumulate=False,
                            fast_accum=fast_accum)
        return run

    runnable: dict[str, Callable[[], Any]] = {}
    configs: dict[str, TileConfig] = {}
    pool = session.pool if session is not None else "default"
    for cfg in candidates_for(epi, operands, promote=is_fp8(A.dtype) and not fast_accum, pool=pool):
        run = call(cfg)
        try:
            run()  # compiles; a config this shape cannot use is skipped
        except Exception as e:  # noqa: BLE001
            times[str(cfg)] = float("nan")
            logging.getLogger(__name__).warning("tune: %s failed: %s: %s", cfg, type(e).__name__,
                                                str(e)[:200])
            continue
        runnable[str(cfg)], configs[str(cfg)] = run, cfg
    if not runnable:
        raise RuntimeError("no candidate config ran")
    if steady_s:
        times.update({name: measure_steady(run, seconds=steady_s).ms for name, run in runnable.items()})
    else:
        times.update({name: t[len(t) // 2] for name, (t, _) in measure_each(runnable, reps).items()})
    best = configs[min(runnable, key=times.__getitem__)]
    dtype, device = mainloop_key(A, B, fast_accum), _device_name(A.device.index or 0)
    key = tuning_key(epi, m, n, k, dtype, device)
    regime = (f"steady {steady_s} s" if steady_s else "single calls") + ("" if pool == "default" else f", {pool} pool")
    call = {"epilogue": getattr(epi, "name", "plain"), "MNK": [m, n, k], "dtype": str(dtype), "gpu": device}
    TuningCache().put(key, best, times, regime, call)
    _forget_lookups()  # later lookups see the new winner
    if session is not None:
        session.append({"epilogue": call["epilogue"], "MNK": [m, n, k], "best": str(best),
                        "times_ms": times, "regime": regime})
    return best, times
