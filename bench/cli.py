"""Command-line entry points: `specsweep` (a Hydra app) and the end-of-sweep summary.

Exit status: 0 every job ok (or skipped: a workload unavailable here); 1 some jobs failed or timed
out (their error rows, the table and the report are still written); 2 bad input (nothing ran: in a
multirun every job is checked first, bench/sweeper.py; Hydra's own refusals of the command line, a
value of the wrong type or an unknown option, are 2 as well)."""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from .config import ConfigError, register_configs
from .pace import duration
from .results import FAILED_STATUSES
from .summary import TABLE_COLUMNS

log = logging.getLogger("specsweep")
register_configs()


class SweepProgress:
    """Where a sweep stands: jobs done of the total and the time left at the pace so far. One per
    sweep process (Hydra's basic launcher runs the jobs one after another in it; launchers that run
    them elsewhere report per job only).

    Jobs are weighed by the tokens they will prefill and decode (both arms, every repeat:
    bench.jobspec.job_work), a prompt token counted as the share of a decode step the jobs done so
    far measured it to cost (their TTFT per prompt token over their TPOT), so a sweep whose last
    jobs read 8k-token prompts is not told it is nearly done after its short ones."""
    total = 0
    done = 0
    started = 0.0
    work: list = []  # per job, in launch order: (prompt tokens, decode tokens)
    prefill_ratios: list = []  # per finished job: a prompt token's cost in decode steps

    @classmethod
    def begin(cls, total: int, work: list | None = None) -> None:
        cls.total, cls.done, cls.started = total, 0, time.monotonic()
        cls.work, cls.prefill_ratios = list(work or []), []

    @staticmethod
    def prefill_ratio(row: dict) -> float | None:
        """A prompt token's cost in decode steps: the row's TTFT per prompt token over its TPOT."""
        ttft, tpot, n = row.get("ttft_p50"), row.get("tpot_p50"), row.get("prompt_tokens_median")
        if all(isinstance(v, (int, float)) and v == v and v > 0 for v in (ttft, tpot, n)):
            return ttft / n / tpot
        return None

    @classmethod
    def record(cls, row: dict) -> None:
        """A finished job's row: its prefill ratio, where it has one."""
        if (r := cls.prefill_ratio(row)) is not None:
            cls.prefill_ratios.append(r)

    @classmethod
    def _units(cls, jobs) -> float:
        r = sorted(cls.prefill_ratios)[len(cls.prefill_ratios) // 2] if cls.prefill_ratios else 0.0
        return sum(prompt * r + decode for prompt, decode in jobs)

    @classmethod
    def left_s(cls) -> float | None:
        """Seconds left at the pace of the jobs done so far (None before the first is done):
        weighed by the jobs' tokens where they are known, else one job counting as any other."""
        if not cls.done:
            return None
        elapsed = time.monotonic() - cls.started
        if len(cls.work) == cls.total and cls._units(cls.work[:cls.done]) > 0:
            return elapsed * cls._units(cls.work[cls.done:]) / cls._units(cls.work[:cls.done])
        return elapsed / cls.done * (cls.total - cls.done)

    @classmethod
    def label(cls) -> str:
        if not cls.total:
            return ""
        left = cls.left_s()
        return f"job {min(cls.done + 1, cls.total)}/{cls.total}" + (f", about {duration(left)} left" if left else "")


def _progress_factory(name: str, total: int):
    """The current job's batches: a bar on a terminal, a log line per batch elsewhere (CI logs)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    tty = sys.stderr.isatty()
    where = SweepProgress.label()
    prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    transient=False, disable=not tty)
    prog.start()
    task = prog.add_task((f"[{where}] " if where else "") + name[:60], total=total)

    def step(n: int = 1, close: bool = False):
        if close:
            prog.stop()
        else:
            prog.advance(task, n)
            if not tty:
                done = int(prog.tasks[0].completed)
                log.info("%s%s: %d/%d batches measured", f"[{where}] " if where else "", name, done, total)

    return step


# The CLI table's short headers, one legend line explaining them (every column: docs/columns.md).
SHORT = {"backend": "engine", "batch_size": "batch", "num_speculative_tokens": "k", "temperature": "T", "speedup": "speedup [95%]",
         "acceptance_rate": "alpha", "mean_acceptance_length": "tau",
         "verify_fraction": "verify", "draft_fraction": "draft", "baseline_roofline_share": "roofline",
         "load_label": "load", "tpot_speedup": "TPOT x", "goodput_rps": "goodput", "baseline_goodput_rps": "goodput off",
         "aa_verdict": "A/A", "prompt_tokens": "in"}
LEGEND = ("alpha: acceptance rate; tau: mean acceptance length; k: draft length (at most); verify, draft: share of "
          "decode time; roofline: "
          "baseline step against its weight-read time (below 50% flagged); TPOT x: TPOT speedup under load; "
          "every column: docs/columns.md")
PERCENT = {"verify_fraction": 0, "draft_fraction": 1, "baseline_roofline_share": 0}


def _table_width() -> int:
    """120 by default, whatever the terminal (a table that fits any common terminal and CI log);
    COLUMNS=N asks for N."""
    import os

    try:
        return max(60, int(os.environ["COLUMNS"]))
    except (KeyError, ValueError):
        return 120


def print_table(df, title: str = "specsweep", width: int | None = None) -> None:
    import pandas as pd
    from rich import box
    from rich.console import Console
    from rich.table import Table

    cols = [c for c in TABLE_COLUMNS if c in df.columns]
    if "load_kind" in df.columns and (df.load_kind.fillna("static") != "static").any():
        # load points: the level says what ran (batch_size is the rows the engine was given)
        cols = cols[:3] + ["load_label"] + cols[3:] + [c for c in ("tpot_speedup", "goodput_rps", "baseline_goodput_rps")
                                                         if c in df.columns]
    if "prompt_tokens" in df.columns and df.prompt_tokens.notna().any():  # input length: an axis of this sweep
        cols = cols[:4] + ["prompt_tokens"] + cols[4:]
    aa = df.aa_control.fillna(False).astype(bool) if "aa_control" in df.columns else None
    if aa is not None and aa.any():  # A/A controls: whether each reads 1.0 within its intervals
        cols.append("aa_verdict")
    loaded = "load_label" in cols
    if loaded:  # under load the level is the point; batch_size is only the rows it gave the engine
        cols = [c for c in cols if c != "batch_size"]
    # a column with nothing in it is left out (an engine without a time split, a load point's
    # acceptance on a deployment without counters), and one with one value in every row goes to
    # the caption instead (engine, method, T, status, ...)
    empty = [c for c in cols if c not in ("method", "speedup") and df[c].isna().all()]
    same = [c for c in cols if c not in empty and c not in ("speedup", "aa_verdict") and len(df) > 1
            and (c == "temperature" or not pd.api.types.is_float_dtype(df[c])) and df[c].astype(str).nunique() == 1]
    cols = [c for c in cols if c not in same and c not in empty]
    t = Table(title=title, caption=" · ".join(f"{SHORT.get(c, c)} {df[c].iloc[0]}" for c in same) or None,
              caption_justify="left", box=box.SIMPLE_HEAD)
    for c in cols:
        t.add_column(SHORT.get(c, c), justify="right" if c not in ("backend", "method", "workload", "status",
                                                                    "lossless", "load_label", "aa_verdict") else "left",
                     no_wrap=True)
    verdicts = []
    for _, r in df.sort_values([c for c in ("workload", "method", "load_kind", "load_level", "batch_size",
                                            "prompt_tokens") if c in df.columns]).iterrows():
        cells = []
        for c in cols:
            v = r[c]
            if c == "speedup" and isinstance(v, float) and v == v:
                lo, hi = r.get("speedup_ci_low"), r.get("speedup_ci_high")
                cells.append(f"{v:.2f} [{lo:.2f}, {hi:.2f}]" if lo == lo and hi == hi and lo is not None else f"{v:.2f}")
            elif c == "method" and r.get("aa_control") is True:
                cells.append(f"{v} (A/A)")
            elif c == "aa_verdict" and isinstance(v, str):
                cells.append("holds" if v.startswith("holds") else "EXCLUDES")
                if not v.startswith("holds"):
                    verdicts.append(f"{r.get('job')}: {v}")
            elif c in PERCENT and isinstance(v, float):
                cells.append("-" if v != v else f"{100 * v:.{PERCENT[c]}f}%")
            elif isinstance(v, float):
                cells.append("-" if v != v else f"{v:.2f}")
            else:
                cells.append("-" if v is None else str(v))
        t.add_row(*cells)
    console = Console(width=width or _table_width(), soft_wrap=False)
    console.print(t)
    console.print(LEGEND, style="dim")
    for line in verdicts:
        console.print(line)


class SweepSummary(Callback):
    """After a sweep: gather the index, print the table, write the report."""

    # Set once the sweep's every job was composed and checked: an exit of 1 before that is Hydra
    # refusing the command line (main() makes it 2, bad input), after it a job or the report failed.
    checked = False

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        from .sweeper import check_sweep

        work = check_sweep(config)  # every job, before any runs: bad input anywhere is exit 2 and nothing runs
        SweepSummary.checked = True
        SweepProgress.begin(len(work or []), work)

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        if SweepProgress.total:
            SweepProgress.done += 1
            left = SweepProgress.left_s()
            log.info("sweep: %d/%d jobs done (%s elapsed, %s)", SweepProgress.done, SweepProgress.total,
                     duration(time.monotonic() - SweepProgress.started),
                     f"about {duration(left)} left" if left else "done")

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        SweepSummary.checked = True

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        self._finish(config)

    def on_run_end(self, config: DictConfig, **kwargs) -> None:
        self._finish(config)

    def _finish(self, config: DictConfig) -> None:
        from .report import write_report
        from .results import build_index

        sweep_dir = Path(config.results_dir).resolve() / config.sweep_name
        if not sweep_dir.exists():
            return
        df = build_index(sweep_dir)
        if df.empty:
            return
        print_table(df, title=f"specsweep: {sweep_dir}")
        errors = df[df.status.isin(FAILED_STATUSES)]
        for _, r in errors.iterrows():
            log.error("job %s: %s", r.job, r.error)
        report_failed = False
        if config.report:
            # Hydra turns an exception in a callback into a warning (exit 0): caught here, so that a
            # report that could not be written is an exit status, while the results stay as written
            try:
                out = write_report(sweep_dir)
                print(f"results: {sweep_dir}\nreport:  {out / 'index.html'} (one page, opens offline; the same as "
                      f"{out / 'summary.md'} and the plots beside it)")
            except Exception as e:
                log.exception("the report could not be written")
                print(f"specsweep: every job's results are in {sweep_dir}, but the report failed: {type(e).__name__}: "
                      f"{e}; rerun it with `specsweep-report {sweep_dir}`", file=sys.stderr)
                report_failed = True
        if len(errors):  # some jobs failed (their rows, the table and the report are written)
            print(f"specsweep: {len(errors)} of {len(df)} jobs failed (status=error or timeout) or lost requests "
                  "(status=partial)", file=sys.stderr)
        if len(errors) or report_failed:
            raise SystemExit(1)


# conf/ sits at the project root; an absolute path finds it from any cwd.
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _job(cfg: DictConfig) -> dict | None:
    from . import pace
    from .jobspec import job_work
    from .runner import run_job

    started = time.monotonic()
    try:
        row = run_job(cfg, progress_factory=_progress_factory)
    except ConfigError as e:
        log.error("%s", e)
        raise SystemExit(2) from None
    SweepProgress.record(row)
    if row.get("status") == "ok":  # the pace a later sweep's estimate starts from
        pace.record(pace.pace_key(cfg), time.monotonic() - started, job_work(cfg), SweepProgress.prefill_ratio(row))
    sp = row.get("speedup")
    log.info("%s: status=%s speedup=%s acceptance=%s", row.get("job"), row.get("status"),
             f"{sp:.3f}" if isinstance(sp, float) else sp, row.get("acceptance_rate"))
    return None


class Terminated(KeyboardInterrupt):
    """SIGTERM (what Slurm, Kubernetes and systemd send to stop or preempt a job), raised where the
    sweep is, as Ctrl-C raises KeyboardInterrupt: the same unwinding (the engine closed, its
    servers stopped, the job left incomplete) and the same summary."""


def _terminated(signum, frame):
    raise Terminated()


def main() -> None:
    """`specsweep`: the Hydra app, with Ctrl-C and SIGTERM answered by a short summary instead of a
    traceback (exit 130 and 143: 128 + the signal's number, as a shell reports a death by it)."""
    import signal

    signal.signal(signal.SIGTERM, _terminated)
    try:
        _job()
    except SystemExit as e:
        # Hydra prints what it could not compose (a value of the wrong type for its key, a config
        # group option that does not exist, an override it cannot parse) and exits 1: bad input,
        # and nothing ran, so the status says that.
        import bench.cli  # under `python -m bench.cli` Hydra's callback is this module's class, not __main__'s

        if e.code == 1 and not bench.cli.SweepSummary.checked:
            raise SystemExit(2) from None
        raise
    except KeyboardInterrupt as e:
        stop = "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"
        print(f"\nspecsweep: {stop}. Every job that completed is kept (each in its own folder, and in the "
              "index); the interrupted one left no result and runs again when the same command is run again, "
              "which skips the completed ones.", file=sys.stderr)
        raise SystemExit(143 if isinstance(e, Terminated) else 130) from None


if __name__ == "__main__":
    main()
