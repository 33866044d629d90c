"""Shared pytest fixtures.  Add yours; keep the others'."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

# --------------------------------------------------------------------------- xdist workers

# scripts/test.sh hands each xdist worker whole modules (--dist loadfile); the modules of a group
# here go to one worker together, for what their tests share in one process.
SHARED_WORKER = {
    # The judges of compile_judge and runtime_judge below (quack and CuTeDSL in the first one's zygote).
    "verifier judges": ("test_verifier_harness.py", "test_verifier_corpus.py"),
}
# Modules that run for tens of seconds (sm_90a compiles, judges, interpreters started for dry runs),
# longest first: they are handed out before the rest, so that each worker ends on short modules and
# neither waits long for the other.  xdist's own order (most tests first) would leave some of them
# for the end.
LONG_FIRST = ("test_expert_compiles.py", "test_verifier_suite.py", "test_verifier_harness.py",
              "test_primitives.py", "test_train_step.py", "test_eval_ray.py", "test_agent_cli.py", "test_bench.py",
              "test_passes.py", "test_gpu_session.py", "test_bench_fp8.py", "test_own_task.py",
              "test_verifier_compile_cache.py", "test_fp8.py")


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with each SHARED_WORKER group one unit of work, the LONG_FIRST units first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    group_of = {f"tests/{module}": group for group, modules in SHARED_WORKER.items() for module in modules}
    first = [group_of.get(f"tests/{module}", f"tests/{module}") for module in LONG_FIRST]

    class SharedWorkerScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return group_of.get(module, module)

        def _assign_work_unit(self, node) -> None:
            for unit in reversed(first):
                if unit in self.workqueue:
                    self.workqueue.move_to_end(unit, last=False)
            super()._assign_work_unit(node)

    return SharedWorkerScheduling(config, log)


# --------------------------------------------------------------------------- every test


@pytest.fixture(scope="session")
def session_compiles(tmp_path_factory):
    """One compile cache for the session (per xdist worker): the compile stage's passed results,
    keyed fail-closed on source, task, libraries and target, so a test that verifies an expert
    reuses the sm_90a compile another test of the session already paid for."""
    return tmp_path_factory.mktemp("session-compiles")


@pytest.fixture(scope="session", autouse=True)
def private_caches_for_the_session(tmp_path_factory, session_compiles):
    """Module-scoped fixtures (a verifier session, a judge) start before any test's own caches."""
    with pytest.MonkeyPatch.context() as mp:
        _private_caches(tmp_path_factory.mktemp("session-caches"), session_compiles, mp)
        yield


@pytest.fixture(autouse=True)
def private_caches(tmp_path_factory, monkeypatch, session_compiles):
    """No test reads or writes the user's caches (verdicts, compiles, tuning): each test gets
    its own CODA_CACHE_DIR and XDG_CACHE_HOME, whose ``compile`` folder is the session's
    (a test that must compile afresh passes ``compile_cache=False`` or sets its own
    CODA_CACHE_DIR)."""
    return _private_caches(tmp_path_factory.mktemp("caches"), session_compiles, monkeypatch)


def _private_caches(root, compiles, mp: pytest.MonkeyPatch):
    """CODA_CACHE_DIR and XDG_CACHE_HOME under ``root``, the compile folder linked to ``compiles``."""
    (root / "coda").mkdir()
    (root / "coda" / "compile").symlink_to(compiles, target_is_directory=True)
    mp.setenv("CODA_CACHE_DIR", str(root / "coda"))
    mp.setenv("XDG_CACHE_HOME", str(root / "xdg"))
    return root / "coda"


# --------------------------------------------------------------------------- verifier


@pytest.fixture(scope="session")
def compile_judge(private_caches_for_the_session):
    """One judge for the verifier's compile stage alone, past the compile cache (its users share a
    worker: SHARED_WORKER)."""
    from coda_agent.verifier import Verifier

    with Verifier(stages=["compile"], cache=False, compile_cache=False) as v:
        yield v


@pytest.fixture(scope="session")
def runtime_judge(private_caches_for_the_session):
    """One judge of the reference stage for programs that got past the static stage (the harness
    tests and the corpus: SHARED_WORKER), started with a secret and a marker in its environment
    that no runner may see."""
    from verifier_helpers import EXPERT_PATH, TASK_PATH

    from coda_agent.tasks.spec import load_task
    from coda_agent.verifier import Verifier

    with Verifier(stages=["reference"], cache=False, timeout_s=60, load_timeout_s=3) as v:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OPENAI_API_KEY", "sk-secret")
            mp.setenv("CODA_MODEL", "marker")
            v.check(load_task(TASK_PATH), EXPERT_PATH.read_text())  # starts the judge, with them
        yield v


# --------------------------------------------------------------------------- bench


@pytest.fixture
def bench_main(monkeypatch):
    """``bench_main(SCRIPT, *ARGS)``: ``bench/SCRIPT.py ARGS`` through its ``main()`` in this
    process, returning what main returns.  A script's start is seconds of imports this process
    has paid for already; each script's own test starts it as a script, as the H200 run does."""
    bench = Path(__file__).resolve().parent.parent / "bench"

    def run(script: str, *args: object) -> int:
        monkeypatch.setattr(sys, "path", [str(bench), *sys.path])  # main may put bench/ on it itself
        monkeypatch.setattr(sys, "argv", [str(bench / f"{script}.py"), *map(str, args)])
        return importlib.import_module(script).main()

    return run


# --------------------------------------------------------------------------- agent


@pytest.fixture
def agent_env(monkeypatch, tmp_path):
    """No user config, endpoint or model leaks into a test."""
    for var in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "CODA_MODEL", "CODA_CONFIG", "CODA_DEBUG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


@pytest.fixture
def openai_server():
    from openai_server import ScriptedServer

    server = ScriptedServer().start()
    yield server
    server.stop()


@pytest.fixture
def agent_task(tmp_path):
    """A tiny task (D = alpha * x @ w + r) in its own folder, with a second task as an example."""
    from agent_fixtures import GOOD, write_task

    from coda_agent.tasks import load_task

    folder = tmp_path / "tasks"
    write_task(folder, "other_task", families="elementwise",
               expert="# the other task's expert program\n" + GOOD)
    return load_task(write_task(folder))
