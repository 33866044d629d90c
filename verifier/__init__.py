"""The verifier: a program and a task in, one :class:`Report` out.

``accepted`` must mean correct and fast, and the program is assumed to be an
adversary that knows this source.  So the verdict comes from a process the
program never runs in, and every guarantee rests on what that process checks
itself.  Three processes (the judges that were gamed and then hardened drew
the same lines: KernelBench's ``src/eval.py`` after its reward-hacking unit
tests and issue #165 (zeros passed a bf16 tolerance), the GPU MODE evaluator
(gpu-mode/kernelbot, reference-kernels: the submission in another process, a
secret seed combined into every test's, timed calls re-checked), Sakana's
robust-kbench (several input and init settings per task, forward and
backward)):

1. **The harness** (:mod:`.harness`, in the caller): the static stage, the
   verdict cache, the backstop on time, the Report.  It never imports the
   program.
2. **The judge** (:mod:`.judge`, :mod:`.check`): loads the task and its
   reference, draws inputs from seeds only it sees, runs the reference on its
   own copies, compares, times the baselines, decides each stage.  It never
   executes candidate code and never unpickles what it receives.
3. **The runner** (:mod:`.runner`), one per check, behind walls
   (:mod:`.sandbox`): the only process the program runs in.  It holds no
   verdict, reference, seed or path to anything the verdict is written on;
   it calls the program on what it is sent and sends back the results
   (:mod:`.wire`: JSON and raw bytes; on the GPU, CUDA IPC of memory the
   runner owns, :mod:`.cuda_ipc`).  From the moment the program loads, the
   judge believes nothing the runner says that it cannot check.

What each stage guarantees, and what it does not:

- **static** (:mod:`.static`): an AST filter with per-name provenance, the
  fast first answer with the program's own line.  Guarantees nothing: a
  Python sandbox by AST rules is escapable, so no check below depends on it
  (the corpus runs its runtime families with it switched off).
- **reference** (CPU, :mod:`.stages`): the catalogue's PyTorch lowering against
  the task's reference on every named shape set under a size budget (at least
  small and ragged), one set beyond them (the ragged sizes grown by 256 and
  by a secret amount the judge draws per check, so that no checked size can
  be read off the task file: :mod:`.inputs`), the CPU set with an odd token
  count below its own and one with a short aligned count (a multiple of 8
  below it), and any the task names, each with two fresh draws (the second
  with one to three outlier channels at 8 to 64 times in every hidden state,
  :mod:`.outliers`), one of edge rows (norms of 2^-12, 2^5, between and 0,
  gradients along the output or 0, a cross-entropy target in two the class
  the reference predicts) and two at other magnitudes (activations 2^u and
  2^-u, |u| in [4, 12], half the rows negated, centres moved 16 to 64 times as
  far; norm weights, scales, tables and biases spread; fp8 inputs over their
  range), all but the first with the
  task's float params varied, and for a task with a backward the first draw's
  forward alone (a backward may not mend its forward's outputs in place); a
  backward that declares ``needs`` is also asked, on
  each of those draws, for every smaller gradient set a caller may ask for
  (``kernels/contract.py``), each gradient asked for held to the reference.  Guaranteed
  by the judge: every declared result is present with its declared dtype and
  shape (gradients: the input's dtype or fp32), every value within the
  tolerance of the judge's own reference (CODA's max rule, a norm rule and a
  bias rule, :mod:`.compare`; a result that fails them by the size of its
  errors alone is judged again against eight more samples of the reference's
  noise, :mod:`.noise`, where one element carries most of it), no result
  identical for two different draws.
  Not guaranteed: that inputs were left alone (on the CPU the runner reports
  digests; the reference never sees its copies, so a mutation can only hurt
  the program's own results); that no PyTorch compute ran (the runner's
  ``TorchAudit``: advice for honest programs); that the program is right at
  sizes outside those checked (a program right on a whole range of sizes
  around the checked ones and wrong past it passes), or at param values
  outside the judge's draw (a factor of up to 16 around the task's).
- **compile** (sm_90a, in the runner): the SASS gate (HGMMA in every GEMM, spills,
  slow-path calls).  The runner reports it, so it is a diagnostic: a program
  that took over its runner could fake its own compile stage, never its
  correctness or speed.
- **correctness** (GPU): the cute lowering against the fp32 reference on
  every named set that fits the device's *total* memory (chosen before the
  program runs: holding memory starves no check; an out-of-memory rejects when
  the program's process holds more than a call of the largest set needs, and is
  the judge's error otherwise, ``check.out_of_memory``), plus the beyond set and the odd and short sets
  (a program that tells the device it runs on is held at them here too), two fresh draws, edge rows and two at other
  magnitudes each (params varied as on the CPU) and the forward alone, outputs NaN-poisoned,
  each call repeated for determinism.  Guaranteed by
  the judge: as for the reference stage, plus inputs unmodified (the judge
  reads the runner's input buffers itself) and results that share no memory
  with inputs or each other (an upstream gradient may be returned as it is).
  The poisoning runs in the runner: a diagnostic for unwritten tiles.
- **launch audit** (GPU): what the profiler in the runner saw launched, all
  inside catalogue calls.  A rule for honest programs, not a guarantee.
- **performance** (GPU, :mod:`.timing`): on the largest set that fits (the
  next one, named in the verdict, where the judge's baselines run the card
  out of memory with the program within its share; no verdict where the
  host outlasts the call there), the
  program in the runner and the plain GEMMs, eager and torch.compile in the
  judge, interleaved in random rounds; every timed call on a fresh draw (a
  runner's memo of results keyed by their inputs misses); results of calls
  picked at random after they return compared; the judge's own wall clock
  over back-to-back blocks bounding every contender's time from below; a
  fresh recomputation after timing; the baselines timed again with the
  runner ended, no baseline in the verdict more than 10% over its time alone
  (a runner that kept the GPU busy while idle slowed the baselines alone).
  Guaranteed: the time the verdict uses is no less than the judge measured
  from outside, so uncovered side streams, deferred work and patched timers
  buy nothing; faster than the plain GEMMs by
  more than 10% is a rejection; meeting ``Target.vs_gemm`` and
  ``Target.vs_compile`` is accepted, missing either ``correct_slow`` with a
  performance report.  Not guaranteed: GPU work the runner leaves running
  after it answers is caught only by the result checks that race it (CUDA
  gives no cross-process view of another context's queue).

Not guaranteed by any stage, because every check is a finite run of the
program inside its runner: that it computes the same outside the runner (a
program can tell its walls, its modules or the judge's call pattern apart and
be honest only there; the static stage's rules, which an accepted program
passed, and human review are what hold it in a training run); that state it
keeps across calls changes nothing after more calls than a check makes (the
runner checks that each call leaves the module's values as it found them,
``program.module_state``: a counter in a module-level list or tensor, a
helper's default or a closure cell is refused at its first call; state kept
where the module does not reach, an attribute of a catalogue object, is not
seen); that it is right on inputs unlike the judge's draws (they follow the
task's declared distributions plus the edge rows, in code its author has read:
a program that reads its inputs past the ``TorchAudit``, which runs in its own
runner, can be right only on them; the outlier channels reach 64 times the
rest of a row, where massive activations reach 10^3: a program that clips past
64 times passes (:mod:`.outliers`); and the max and norm rules are per
tensor, so the outlier channels set both bars for every element of their draw:
a program that rounds only rows holding an outlier to a 9-bit grid of the
row's maximum, 4 to 5% RMS error on their other channels, passes at the
CPU sets' widths, H of 128 to 700 (red-team round 8); a rule on each row's and
column's median error against the reference's median noise there rejects it,
but honest experts stand as far off in some lines (GPT-2's ln_qkv dx: 23 times
the reference's median noise in a row, second look included, where its row sums
round otherwise), so no such rule is in; the edge draw's whole-row rule,
:mod:`.compare`, judges only rows that err by half their own norm, a row lost
or made up, not rounded);
that it is right at a token count none of the sets holds (one, a decode
step's, is the odd set's one time in 128).  A Report covers the stages it lists:
``cpu_passed`` of a ``stages`` subset means every stage that ran passed, so
what a run directory's verdict backs (``coda_agent.kernels.source.unbacked``:
the program's sha256, the outcome, the task, the static and reference stages
passed) is checked before ``review``, ``export`` or ``load_kernel`` trusts it.

Disk: what a runner's writable directories hold is bounded by the judge
(:mod:`.disk`).  Processes: what a runner starts stays below the judge and ends
with the runner, whichever session it moved to (:mod:`.strays`).  Time: the program's running time (``timeout_s``) and each load
(``load_timeout_s``) are limited by the judge; time spent waiting for the GPU
lock (:mod:`.gpu_lock`) never counts.  A crash, a hang, a killed judge: each
is the verdict of the stage it happened in, and so is a runner reply the
judge cannot read (a field of the wrong type is the program's failure, never
the judge's error).  Verdicts are cached, signed, on a
fail-closed key that covers the verifier's code and the reference's files
(:mod:`.cache`); passed compiles too (:mod:`.compile_cache`).  :mod:`.feedback`
renders a report for the LLM, :mod:`.cli` for people.  Tests:
tests/test_verifier*.py and the families of tricks in tests/bad_programs/.
"""

from coda_agent.verifier.harness import Verifier
from coda_agent.verifier.report import CORRECT, GPU_STAGES, STAGES, Mismatch, Report, StageResult

__all__ = ["CORRECT", "GPU_STAGES", "STAGES", "Mismatch", "Report", "StageResult", "Verifier"]
