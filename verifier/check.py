"""One check inside the judge (:mod:`.judge`): the task, the program, its limits and its runner.

:class:`Check` holds a check request and the runner that serves it (started
on first use, :mod:`.remote`); its :meth:`Check.request` is how every stage
talks to the runner, within what is left of the check's time budget.
:class:`Judge` runs a check's stages in order, each GPU stage under the GPU
lock (:mod:`.gpu_lock`), and turns whatever a stage raises into its result: a
:class:`CandidateError` is the program's failure, anything unexpected the
judge's own error (``error``: not the candidate's fault).  A CUDA
out-of-memory, the judge's or the runner's, is weighed (:func:`out_of_memory`):
the program's failure when its runner holds more than a runner needs for the
largest set, else the judge's error, which names the card's size and the
smaller sets to check.  Before each runner request of a GPU stage the judge
gives its cached blocks back to the card, which the two processes share.
"""

from __future__ import annotations

import random
import re
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from coda_agent.tasks.spec import Task, load_task
from coda_agent.verifier import sandbox
from coda_agent.verifier.gpu_lock import gpu_lock
from coda_agent.verifier.inputs import drawn_magnitude, drawn_params, reference_takes, result_dtypes
from coda_agent.verifier.program import CandidateError, poison_bytes
from coda_agent.verifier.remote import Remote, RunnerTimeout, WallsTooHigh
from coda_agent.verifier.report import GPU_STAGES, StageResult
from coda_agent.verifier.shape_sets import checked_sets, set_bytes, with_drawn_sets
from coda_agent.verifier.trees import remove_tree
from coda_agent.verifier.zygote import Zygote


class Check:
    """One check request: the task, the program, the limits, and the runner (started lazily)."""

    def __init__(self, judge: "Judge", req: dict[str, Any]):
        self.judge = judge
        self.rng = random.SystemRandom()  # seeds, choices and sizes no process but the judge sees
        self.task: Task = load_task(req["task_path"])
        self.spec = with_drawn_sets(self.task.spec, self.rng)
        # The varied params of the later draws, within what the reference takes.
        self.params = drawn_params(self.spec, self.rng, lambda p: reference_takes(self.task, self.spec, p))
        self.magnitude = drawn_magnitude(self.rng)  # the scaled draw's exponent
        self.source: str = req["source"]
        self.python_rules: bool = req.get("python_rules", True)
        self.shape_sets: list[str] | None = req.get("shape_sets")
        self.reps: int = req["reps"]
        self.compile_cache: bool = req.get("compile_cache", False)
        self.timeout_s: float = req["timeout_s"]
        self.load_timeout_s: float = req["load_timeout_s"]
        self.runner_s = 0.0  # what the runner has spent answering, against timeout_s
        self.remotes: dict[bool, Remote] = {}  # by cuda: a CPU runner, then a GPU one (on a GPU machine)
        self.walls: dict[str, str] = {}  # "cpu"/"cuda" -> the walls its runner reported
        self.gpu_stage = False  # set by the judge per stage: a GPU stage needs a CUDA runner
        self.cuda = torch.cuda.is_available()

    def seed(self) -> int:
        return self.rng.randrange(1 << 31)

    def contract(self) -> dict[str, Any]:
        spec = self.spec
        # A call's params travel with it; these serve the compile stage, on the CPU shape set.
        return {"inputs": list(spec.inputs), "params": spec.params_at(spec.cpu_shape_set),
                "outputs": {o: t.dtype for o, t in spec.outputs.items()}, "gradients": list(spec.gradients),
                "grad_outputs": list(spec.grad_outputs), "result_dtypes": result_dtypes(spec)}

    def runner(self) -> Remote:
        """The runner for the current stage: the CPU stages (reference, compile) run the
        program on the CPU, also on a GPU machine; the GPU stages in a CUDA runner.  A runner
        is started on first use and again after it died; the other device's is closed."""
        cuda = self.cuda and self.gpu_stage
        other = self.remotes.pop(not cuda, None)
        if other is not None:
            other.close()
        remote = self.remotes.get(cuda)
        if remote is None or remote.dead:
            if remote is not None:
                remote.close()
            while True:
                scratch = Path(tempfile.mkdtemp(prefix="run-", dir=sandbox.runners_root()))
                try:
                    remote = Remote(self.source, scratch, cuda, self.judge.zygote(), int(self.timeout_s) + 600,
                                    self.judge.sandbox_mode[cuda])
                    break
                except WallsTooHigh as e:
                    remove_tree(scratch)
                    self.judge.lower_walls(cuda, str(e))
            self.remotes[cuda] = remote
            self.walls["cuda" if cuda else "cpu"] = remote.walls
        return remote

    def request(self, header: dict[str, Any], blobs: Sequence[bytes | memoryview] = (),
                max_bytes: int = 0) -> dict[str, Any]:
        """A runner request within what is left of the check's time budget."""
        left = self.timeout_s - self.runner_s
        if self.gpu_stage and torch.cuda.is_initialized():
            # the judge's cached blocks (a large set's fp32 reference and its temporaries) go back to
            # the card before the runner allocates: it shares the card with the judge
            torch.cuda.empty_cache()
        t0 = time.monotonic()
        try:
            return self.runner().request(header, blobs, timeout=max(left, 0.001), max_bytes=max_bytes)
        except RunnerTimeout as e:
            raise CandidateError(f"timed out after {self.timeout_s:.0f} s (killed): an infinite loop, a hang "
                                 "or a deadlock in the program; forward/backward must be straight-line "
                                 "catalogue calls", log=e.log) from None
        finally:
            self.runner_s += time.monotonic() - t0

    def load(self, tag: str, lowering: str) -> None:
        """Load the program in the runner under its own time limit."""
        header = {"op": "load", "tag": tag, "lowering": lowering, "source": self.source,
                  "python_rules": self.python_rules, "contract": self.contract()}
        try:
            self.runner().request(header, timeout=self.load_timeout_s)
        except RunnerTimeout as e:
            raise CandidateError(f"loading the program took longer than {self.load_timeout_s:.0f} s (killed): "
                                 "module-level code runs once at import and must be declarations and "
                                 "constants, not computation", log=e.log) from None

    def end_runner(self) -> None:
        """End the current stage's runner now (a later request starts another): its process group
        is killed, and with the process its device context and every kernel it left queued."""
        remote = self.remotes.pop(self.cuda and self.gpu_stage, None)
        if remote is not None:
            remote.kill()
            remote.close()

    def close(self) -> None:
        for remote in self.remotes.values():
            remote.close()
        self.remotes.clear()


class Judge:
    def __init__(self, emit: Callable[[dict[str, Any]], None], zygote: Zygote | None, compiles: bool):
        self.emit = emit
        self._zygote = zygote
        self.compiles = compiles  # checks may run the compile stage: a zygote loads its libraries
        self.broken = False  # a CUDA error poisoned this process: finish the check, then exit
        # by cuda: a GPU runner's mode is lowered where CUDA fails behind the walls (sandbox.py)
        self.sandbox_mode = {False: sandbox.mode(), True: sandbox.mode()}
        self.lowered: list[str] = []

    def lower_walls(self, cuda: bool, why: str) -> None:
        """CUDA failed behind the walls of ``self.sandbox_mode[cuda]`` before any program ran:
        the next such runners get the next mode down; below ``none`` the machine cannot run
        GPU checks."""
        lower = sandbox.weaker(self.sandbox_mode[cuda])
        if lower is None:
            raise RuntimeError(f"CUDA does not start in a runner even with CODA_SANDBOX=none: {why}")
        self.lowered.append(f"{self.sandbox_mode[cuda]} -> {lower} ({why})")
        self.sandbox_mode[cuda] = lower

    def zygote(self) -> Zygote | None:
        """The runner zygote, on a machine without CUDA (:mod:`.zygote`)."""
        if torch.cuda.is_available():
            return None
        if self._zygote is None:
            self._zygote = Zygote(self.compiles)
        return self._zygote

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.close()

    def check(self, n: int, req: dict[str, Any]) -> None:
        from coda_agent.verifier.stages import STAGE_FUNCTIONS

        check = None
        versions: dict[str, str] = {}
        try:
            check = Check(self, req)
            for stage in req["stages"]:
                self.emit({"check": n, "start": stage})
                res = self._stage(n, check, stage, STAGE_FUNCTIONS[stage])
                self.emit({"check": n, "result": res.model_dump()})
                if res.status in ("failed", "error"):
                    break
            if check.walls:
                versions["sandbox"] = "; ".join(f"{dev}: {walls}" for dev, walls in check.walls.items()) + \
                    "".join(f"; lowered: {why}" for why in self.lowered)
        except Exception as e:  # noqa: BLE001 - the task or the request is unusable: the harness's problem
            self.emit({"check": n, "result": StageResult(
                name=req["stages"][0], status="error", message=f"the judge could not start the check: "
                f"{type(e).__name__}: {e}", log=traceback.format_exc()[-4000:]).model_dump()})
        finally:
            if check is not None:
                check.close()
            if torch.cuda.is_available() and torch.cuda.is_initialized() and not self.broken:
                torch.cuda.empty_cache()
        self.emit({"check": n, "done": {"versions": versions}})

    def _stage(self, n: int, check: Check, stage: str, fn: Callable[[Check], StageResult]) -> StageResult:
        t0 = time.perf_counter()
        waited = 0.0
        check.gpu_stage = stage in GPU_STAGES
        try:
            if stage in GPU_STAGES:
                self.emit({"check": n, "waiting": stage})
                with gpu_lock(stage) as w:
                    waited = w[0]
                    self.emit({"check": n, "waited": round(waited, 3)})
                    res = fn(check)
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()  # a neighbour waiting for the lock needs the memory
            else:
                res = fn(check)
        except CandidateError as e:
            res = (stage in GPU_STAGES and runner_out_of_memory(stage, check, e.message)) or StageResult(
                name=stage, status="failed", message=e.message, line=e.line, log=e.log)
        except torch.OutOfMemoryError as e:
            res = out_of_memory(stage, check, str(e))
        except Exception as e:  # noqa: BLE001 - the judge's own failure: not the candidate's fault
            self.broken = self.broken or "CUDA error" in str(e)
            res = StageResult(name=stage, status="error", log=traceback.format_exc()[-4000:],
                              message=f"verifier error in stage {stage}: {type(e).__name__}: {e}")
        res.seconds = round(time.perf_counter() - t0 - waited, 3)
        if waited > 0.01:
            res.details["gpu_wait_s"] = round(waited, 2)
        return res


# A runner's CUDA context, library workspaces and compiled kernels, and the judge's own context,
# which its allocator's reserve does not count (about 0.65 GiB each on an H100 with CUDA 13)
RUNNER_CONTEXT = 3 << 30


def out_of_memory(stage: str, check: Check, error: str) -> StageResult:
    """A CUDA out-of-memory in a GPU stage, weighed by who holds the card: what the judge's process
    reserved, and everything else in use (the runner's process) against what a runner needs for
    the largest set checked (its buffers and the poisoned block, :func:`memory_verdict`)."""
    try:
        free, total = torch.cuda.mem_get_info()
        judge = torch.cuda.memory_reserved()
    except RuntimeError as e:  # the card cannot say who holds it: no verdict on the program
        return StageResult(name=stage, status="error", message=f"the GPU ran out of memory and then could not "
                           f"report its use ({e}): {error[:300]}")
    return memory_verdict(stage, judge, total - free - judge, total, *_largest_set(check, total), error)


def _largest_set(check: Check, total: int) -> tuple[str, int]:
    """The largest set the check runs on a card of ``total`` bytes, and its bytes in fp32."""
    sets = checked_sets(check.spec, check.shape_sets, total)[0]
    largest = max(sets, key=lambda s: set_bytes(check.spec, s, itemsize=4))
    return largest, set_bytes(check.spec, largest, itemsize=4)


_SIZE = r"([\d.]+) (GiB|MiB|KiB|B)\b"
_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}


def runner_out_of_memory(stage: str, check: Check, error: str) -> StageResult | None:
    """A CUDA out-of-memory the runner raised (PyTorch's message, ``error``), weighed as
    :func:`out_of_memory` weighs the judge's, by the runner's own demand: what its process held
    plus what it asked for, against a runner's share for the largest set checked.  None where
    ``error`` is no such message (the program's failure as it stands)."""
    found = runner_oom_bytes(error)
    if found is None:
        return None
    asked, held, free, total = found
    return memory_verdict(stage, max(total - free - held, 0), held + asked, total, *_largest_set(check, total),
                          error, held="held and asked for")


def runner_oom_bytes(error: str) -> tuple[int, int, int, int] | None:
    """(bytes asked for, bytes the process held, bytes free, the card's bytes) from PyTorch's
    out-of-memory message, or None where ``error`` is not one."""
    if "raised OutOfMemoryError" not in error:
        return None
    found = [re.search(pattern, error) for pattern in (
        rf"Tried to allocate {_SIZE}", rf"this process has {_SIZE} memory in use",
        rf"total capacity of {_SIZE} of which {_SIZE} is free")]
    if not all(found):
        return None
    asked, held, card = found

    def size(m: re.Match, at: int = 1) -> int:
        return int(float(m.group(at)) * _UNITS[m.group(at + 1)])
    return size(asked), size(held), size(card, 3), size(card)


def memory_verdict(stage: str, judge: int, others: int, total: int, largest: str, largest_bytes: int,
                   error: str, held: str = "held") -> StageResult:
    """The program's failure when the rest of the card's use (``others``: its runner) passes a
    runner's share for a set of ``largest_bytes`` in fp32; else the judge's error: the card is
    too small for its checks of that set, which is no verdict on the program."""
    def gib(b: float) -> str:
        return f"{b / 2**30:.1f} GiB"

    share = RUNNER_CONTEXT + largest_bytes + poison_bytes(largest_bytes, total)  # the runner's call and its poison
    if others > share:
        return StageResult(name=stage, status="failed", message=(
            f"the GPU ran out of memory while the judge checked the program: the program's process {held} "
            f"{gib(others)} of the card's {gib(total)}, more than a call of the largest set ({largest}, "
            f"{gib(largest_bytes)} in fp32) needs ({gib(share)}); a program must not keep memory between "
            f"calls (no caches, no buffers kept in the module): {error[:300]}"))
    return StageResult(name=stage, status="error", message=(
        f"the GPU ({gib(total)}) is too small for the judge's checks of shape set {largest} "
        f"({gib(largest_bytes)} in fp32): the judge held {gib(judge)} and the program's process "
        f"{gib(others)}, within its share; not the program's fault. Check smaller sets (--sets) or "
        f"use a card with more memory: {error[:300]}"))
