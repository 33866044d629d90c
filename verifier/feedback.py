"""A Report rendered for the LLM's next message: what failed, at which of the
program's own lines (quoted), where the numbers differ, and the timing against
the target.  For a correct but slow program (``correct_slow``) it is the
performance report: the time against both targets, where the time goes (each
catalogue launch's device time and tile configuration, GEMM launches against
the plain GEMMs, the auxiliary kernels), what is over budget, and the register
spills and slow-path calls the compile stage found.  Short on purpose: the
model needs the fix, not the harness's log.
"""

from __future__ import annotations

from coda_agent.verifier.report import Report, StageResult, indented

LOG_LINES = 25


def _quote(source: str, line: int | None) -> str:
    lines = source.splitlines()
    if line is None or not 1 <= line <= len(lines):
        return ""
    lo, hi = max(1, line - 1), min(len(lines), line + 1)
    return "\n".join(f"{'>' if i == line else ' '} {i:4d} | {lines[i - 1]}" for i in range(lo, hi + 1))


def _trim_log(log: str) -> str:
    lines = [ln for ln in log.strip().splitlines() if ln.strip()]
    if len(lines) <= LOG_LINES:
        return "\n".join(lines)
    return "\n".join(lines[:5] + ["..."] + lines[-(LOG_LINES - 6):])


def _stage_text(stage: StageResult, source: str) -> list[str]:
    out = [f"Stage `{stage.name}` {stage.status.upper()}: {indented(stage.message)}"]
    violations = stage.details.get("violations") or []
    for v in violations[:8]:
        out.append(f"- line {v['line']}: {v['message']}")
        if q := _quote(source, v["line"]):
            out.append(q)
    if not violations and (q := _quote(source, stage.line)):
        out.append(f"At line {stage.line}:\n{q}")
    for m in stage.mismatches[:6]:
        rel = "" if m.rel_norm_err is None else f", relative norm error {m.rel_norm_err:.3g}"
        if m.pattern.startswith("systematic bias"):  # a rule on the mean: the pattern holds its numbers
            out.append(f"- `{m.tensor}` ({m.shape_set}): {m.pattern}; max abs error {m.max_abs_err:.3g}{rel}")
            continue
        nans = f", {m.nan_count} NaN" if m.nan_count else ""
        unwritten = f", {m.unwritten_count} never written" if m.unwritten_count else ""
        out.append(f"- `{m.tensor}` ({m.shape_set}): {m.pattern}; max abs error {m.max_abs_err:.3g} > allowed "
                   f"{m.allowed:.3g}, worst at index {m.worst_index}{rel}{nans}{unwritten}")
    if stage.log and stage.name in ("compile",) or (stage.log and stage.status == "failed" and not stage.mismatches
                                                      and stage.name != "static"):
        log = _trim_log(_program_frames_only(stage.log))
        if log:
            out.append("Log (trimmed):\n" + "\n".join("  | " + ln for ln in log.splitlines()))
    if spills := stage.details.get("spills"):
        out.append("Register spills (STL/LDL instructions): "
                   + ", ".join(f"{k}: {v}" for k, v in spills.items()))
    return out


def _program_frames_only(log: str) -> str:
    """Drop traceback frames inside the harness and libraries; keep the program's."""
    keep, skipping = [], False
    for ln in log.splitlines():
        if ln.startswith('  File "'):
            skipping = "<program:" not in ln
        elif not ln.startswith("    "):
            skipping = False
        if not skipping:
            keep.append(ln)
    return "\n".join(keep)


def render_feedback(report: Report, program_source: str) -> str:
    failed = report.failed_stage
    lines = []
    perf = report.stage("performance")
    if failed is None and report.outcome == "correct_slow":
        lines.append(f"CORRECT BUT SLOW: {perf.message}")
    elif failed is None:
        passed = [s.name for s in report.stages if s.status == "passed"]
        skipped = [s.name for s in report.stages if s.status == "skipped"]
        head = "ACCEPTED" if report.accepted else "Passed " + ", ".join(passed)
        lines.append(f"{head}." + (f" Not run here (no GPU): {', '.join(skipped)}." if skipped else ""))
    else:
        verdict = "The verifier itself failed (not your fault)" if failed.status == "error" else "REJECTED"
        lines.append(f"{verdict} at stage `{failed.name}`.")
        lines += _stage_text(failed, program_source)
    if perf is not None and perf.details.get("ms"):
        lines += _timing(perf.details)
    comp = report.stage("compile")
    if failed is not comp and comp is not None and (comp.details.get("spills") or comp.details.get("slow_calls")):
        lines.append("Note: " + comp.message)
    return "\n".join(lines)


def _timing(d: dict) -> list[str]:
    ms = d["ms"]
    out = [f"Timing ({d['shape_set']}): program {ms['program']:.3f} ms, plain GEMMs {ms['gemm']:.3f} ms "
           f"-> {d['vs_gemm']:.2f}x (target <= {d['target_vs_gemm']})"
           + (f", torch.compile {ms['compile']:.3f} ms -> {d['compile_speedup']:.2f}x faster (target >= "
              f"{d.get('target_vs_compile_applied', d.get('target_vs_compile'))})"
              if "compile" in ms and "compile_speedup" in d else "")
           + (f", eager {ms['eager']:.3f} ms" if "eager" in ms else "") + f", {d['tflops']} TFLOP/s."]
    events, walls = d.get("event_ms", {}), d.get("wall_ms", {})
    if d.get("events_trusted") is False:
        out.append("These are back-to-back times (the judge's wall clock): they exceed the program's timed "
                   "events by more than its baselines' do, so work ran outside the events (a side stream, a "
                   "deferred launch) or the host cannot enqueue a call as fast as the GPU runs it.")
    elif walls.get("program", 0) > 1.2 * events.get("program", float("inf")):
        out.append(f"The judge's wall clock per call ({walls['program']:.3f} ms, back to back) exceeds the timed "
                   f"device time ({events['program']:.3f} ms): the host cannot enqueue a call as fast as the GPU "
                   "runs it (fewer launches help), or work ran outside the timed events.")
    prof = d.get("profile")
    if prof:
        budget = d["target_vs_gemm"] * ms["gemm"]
        out.append(f"Budget: {budget:.3f} ms ({d['target_vs_gemm']}x the plain GEMMs); the program is "
                   f"{ms['program'] - budget:+.3f} ms over it.  Catalogue launches, device time of one call: GEMM "
                   f"launches {prof['gemm_launches_ms']:.3f} ms against {prof['plain_gemms_ms']:.3f} ms for the "
                   f"plain GEMMs, auxiliary kernels {prof['aux_launches_ms']:.3f} ms.")
        for name, t in list(prof["kernel_ms"].items())[:8]:
            out.append(f"- {name.removeprefix('coda::')}: {t:.3f} ms")
        if prof.get("configs"):
            out.append("Tile configurations: " + "; ".join(prof["configs"]))
    return out


def report_markdown(report: Report, program_source: str) -> str:
    """The report for a human reviewer: every stage with its time and summary, then
    the feedback text the LLM saw, then the versions the verdict holds for."""
    lines = [f"# {report.task}: {report.outcome}", "", "| stage | status | seconds | summary |",
             "|---|---|---|---|"]
    for st in report.stages:
        summary = st.message.strip().splitlines()[0] if st.message.strip() else ""
        lines.append(f"| {st.name} | {st.status} | {st.seconds:.1f} | {summary.replace('|', '/')[:200]} |")
    lines += ["", render_feedback(report, program_source).rstrip(), "",
              "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(report.versions.items()))]
    return "\n".join(lines) + "\n"
