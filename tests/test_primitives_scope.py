"""The catalogue keeps to itself: importing it loads no quack, CuTeDSL or
Triton and changes nothing in the process; a compile changes quack and the DSL
only while it runs; and the modules of ``primitives/`` import one way, each
only from the layers before it (``primitives/__init__.py`` lists them)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coda_agent.primitives import TileConfig, compile_only, epilogue, gemm

PRIMITIVES = Path(__file__).resolve().parent.parent / "primitives"
# Each module may import only from those on an earlier line (or its own line).
LAYERS = [
    {"errors", "version", "fp8", "dispatch"},
    {"pair"},
    {"reductions"},
    {"operands"},
    {"epilogue"},
    {"tile_config", "lowering", "math", "program", "timing", "destination"},
    {"reference", "dsl_scope", "sass"},
    {"cute", "pass_kernel", "pass_kernel_dsl"},
    {"tuning"},
    {"gemm"},
    {"passes"},
    {"aux", "xent_triton", "quantize", "quantize_triton"},
    {"norm"},
    {"catalogue"},
    {"__init__", "cli"},
]


def test_importing_the_catalogue_loads_no_kernel_library_and_changes_no_environment():
    code = ("import json, os, sys; before = dict(os.environ); import coda_agent.primitives; "
            "print(json.dumps({'loaded': sorted(m for m in ('quack', 'cutlass', 'triton') if m in sys.modules), "
            "'environ': {k: v for k, v in os.environ.items() if before.get(k) != v}}))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUTE_DSL_", "QUACK_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"loaded": [], "environ": {}}


def _local_imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported from this package, whether the import is inside a function)."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            found += [(name.split(".")[0], id(node) not in top) for name in names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("coda_agent.primitives"):
            mod = node.module.split(".")
            names = mod[2:3] or [a.name for a in node.names]
            found += [(name, id(node) not in top) for name in names if (PRIMITIVES / f"{name}.py").exists()]
    return found


def test_primitives_modules_import_one_way_at_the_top():
    layer_of = {name: i for i, names in enumerate(LAYERS) for name in names}
    modules = sorted(p.stem for p in PRIMITIVES.glob("*.py"))
    assert set(modules) == set(layer_of), "add the new module to LAYERS (and to primitives/__init__'s list)"
    for name in modules:
        for imported, lazily in _local_imports(PRIMITIVES / f"{name}.py"):
            where = f"primitives/{name}.py imports .{imported}"
            # aux and quantize import their Triton kernels lazily: Triton loads only for a CUDA tensor.
            # The pass kernel's CuTeDSL side loads cutlass: imported when a pass kernel compiles.
            lazy_ok = {("aux", "xent_triton"), ("quantize", "quantize_triton"), ("pass_kernel", "pass_kernel_dsl")}
            assert not lazily or (name, imported) in lazy_ok, f"{where} inside a function"
            assert layer_of[imported] <= layer_of[name], f"{where}, a layer above it"


@epilogue()
def tripled(acc):  # an epilogue of this test's own: quack compiles it afresh, whatever ran before
    return {"D": acc * 3.0}


@pytest.mark.slow
def test_a_compile_leaves_quack_the_dsl_and_the_environment_as_it_found_them(monkeypatch):
    """The compile target, the kept cubin, quack's disk cache, the driver query, the engineless
    ``cute.compile`` and the pipeline guard are in force during a compile and undone after it."""
    import cutlass.cute as cute
    import quack.cache
    import quack.cute_dsl_utils
    import quack.gemm_runtime.host as host
    from cutlass.cutlass_dsl import CuTeDSL
    from quack.gemm_sm90 import GemmSm90

    envar = CuTeDSL._get_dsl().envar

    def state() -> dict:
        return {"environ": dict(os.environ), "compute_stages": GemmSm90.__dict__["_compute_stages"],
                "clusters": host.get_max_active_clusters, "cache": quack.cache.CACHE_ENABLED,
                "compile": cute.compile, "arch": vars(envar).get("_arch"), "keep_cubin": envar.keep_cubin,
                "dump_dir": envar.dump_dir,
                "capabilities": quack.cute_dsl_utils._get_device_capacity_cached.cache_info().currsize}

    compiled = []  # what the DSL's compile handed back
    dsl_compile = type(cute.compile)._compile
    monkeypatch.setattr(type(cute.compile), "_compile",
                        lambda self, *a, **k: compiled.append(dsl_compile(self, *a, **k)) or compiled[-1])
    before = state()
    A, B = torch.randn(256, 128).bfloat16(), torch.randn(128, 256).bfloat16()
    with compile_only() as kernels:
        gemm(A, B, tripled, config=TileConfig(tile_n=128, cluster_m=1))
    assert kernels[0].sass is not None and kernels[0].sass.sm90a and kernels[0].sass.hgmma > 0
    assert state() == before
    # Without a GPU nothing launches: the kernel has its cubin and no JIT engine (dsl_scope.py).
    assert len(compiled) == 1 and compiled[0].__cubin__
    assert (compiled[0].engine is None) == (not torch.cuda.is_available())
